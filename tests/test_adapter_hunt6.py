"""The manager's own adapter calls under a running engine: after a prefill step the prepared
batch leaves the decoding requests out, and ``LoRAManager.pin_adapter``, ``load_adapter(...,
pinned=True)`` and ``unload_adapter`` took a decoding request's slot or adapter, so every
later step raised. They are refused now, as the engine's calls are, and the requests finish
with the tokens they have alone. A PEFT file without LoRA weights names the file and the fix."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_runtime

from lora_runtime.engine.engine import Engine
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.lora.adapters import AdapterError, random_adapter
from lora_runtime.lora.adapters.peft_format import WEIGHTS, load_peft_adapter, save_peft_adapter
from lora_runtime.lora.slot_pool import SlotPoolError
from lora_runtime.model.config import tiny

CFG = tiny()


def _serving(slots: int = 2):
    """Two slots: a request on "a" decoding, one on "b" just prefilled alone (the prepared
    batch holds "b" only); "c" loaded, in no slot."""
    r = make_runtime(CFG, dtype=torch.float32, device=torch.device("cpu"), slots=slots,
                     max_rank=8)
    for n in "abc":
        r.lora.load_adapter(n, random_adapter(CFG, n, 4, seed=ord(n), b_std=0.3))
    eng = Engine(r, SchedulerConfig(max_batch_size=4, max_step_tokens=64))
    qa = eng.add_request([1, 2, 3], "a", max_new_tokens=6)
    eng.step()
    eng.step()
    qb = eng.add_request([4, 5, 6], "b", max_new_tokens=6)
    eng.step()
    assert eng.timeline[-1].mode == "extend" and r.lora._in_batch == {"b"}
    return r, eng, (qa, qb)


def _finishes(eng, reqs, owners_before):
    eng.run(max_steps=40)
    assert [len(q.output) for q in reqs] == [6, 6]
    return owners_before


def test_the_managers_pin_leaves_the_decoding_requests_their_slots():
    r, eng, reqs = _serving()
    owners = list(r.lora.pool.owner)
    with pytest.raises(SlotPoolError, match=r"3 adapters for 2 slots \(running requests': "
                       r"\['a', 'b'\]"):
        r.lora.pin_adapter("c")
    assert list(r.lora.pool.owner) == owners and not r.lora.pool.pinned
    _finishes(eng, reqs, owners)
    r.lora.pin_adapter("c")  # nothing runs: there is room
    assert "c" in r.lora.pool.pinned


def test_the_managers_pinned_load_is_refused_and_leaves_the_pool_as_it_was():
    r, eng, reqs = _serving()
    owners, loaded = list(r.lora.pool.owner), sorted(r.lora.adapters)
    with pytest.raises(AdapterError, match="cannot pin 'chat'.*for 2 slots"):
        r.lora.load_adapter("chat", random_adapter(CFG, "chat", 4, seed=9), pinned=True)
    assert list(r.lora.pool.owner) == owners and sorted(r.lora.adapters) == loaded
    _finishes(eng, reqs, owners)


def test_the_managers_unload_refuses_an_adapter_that_requests_use():
    r, eng, reqs = _serving(slots=3)
    waiting = eng.add_request([7, 8], "c", max_new_tokens=2)
    for name in ("a", "c"):  # decoding (not in the prepared batch); waiting
        with pytest.raises(RuntimeError, match=f"adapter '{name}' is used by requests"):
            r.lora.unload_adapter(name)
    assert {"a", "b", "c"} <= set(r.lora.adapters)
    _finishes(eng, reqs, None)
    assert len(waiting.output) == 2
    r.lora.unload_adapter("a")  # its request finished
    assert "a" not in r.lora.adapters


def test_a_peft_file_without_lora_weights_names_the_file_and_the_fix(tmp_path):
    save_peft_adapter(random_adapter(CFG, "x", 4, seed=1), tmp_path)
    from safetensors.torch import save_file
    save_file({}, str(tmp_path / WEIGHTS))
    with pytest.raises(AdapterError, match=f"{WEIGHTS}: holds no lora_A/lora_B.*save_pretrained"):
        load_peft_adapter(tmp_path)
