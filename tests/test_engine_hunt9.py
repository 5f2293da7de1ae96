"""Serving-engine defects found in hunt 9, each pinned by a test that failed before its fix.

Before: one prompt's token ids given to ``generate`` / ``add_requests`` as its prompts (a
flat list, or a tokenizer's ``input_ids[0]``) were read as that many prompts: the error said
"3 prompts but 1 adapters", and following it (``[None] * 3``) led to "prompt 0 ... got 5".
With adapters loaded, ``warm_up()`` (which serves "the base model" too) never ran a step without
adapters: each of its phases starts its adapter cycle at the first adapter, so every step held
LoRA rows. A step without adapters makes no LoRA launch and runs other kernels (RoPE, SwiGLU
and the norm without a LoRA term), so those variants were left to compile at a served
base-model step (read from the code path: the interpreter cannot count compiles).
Stop ids given as a 2-D tensor (``tokenizer(text, return_tensors="pt").input_ids``) were
refused as not "one prompt's token ids", naming the prompts' fix ("for several prompts,
Engine.add_requests")."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.scheduler import SchedulerConfig


@functools.cache
def _world() -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, slots=2, kv_tokens=60)


@pytest.mark.parametrize("prompts", [[5, 9, 2], (5, 9, 2), torch.tensor([5, 9, 2])],
                         ids=["list", "tuple", "tensor"])
@pytest.mark.parametrize("adapters", [[None], [None] * 3, None], ids=["one", "three", "none"])
def test_one_prompts_ids_given_as_the_prompts_name_the_fix(prompts, adapters):
    eng = _world().engine(SchedulerConfig())
    with pytest.raises(ValueError, match=r"one prompt's token ids.*\[prompt\]"):
        eng.generate(prompts, adapters, max_new_tokens=2)
    assert not eng.has_work and not eng.finished
    out = eng.generate([prompts], [None], max_new_tokens=2)
    assert len(out) == 1 and len(out[0]) == 2


@pytest.mark.parametrize("batch", [1, 4])
def test_the_warm_up_runs_base_model_steps_beside_adapter_steps(batch):
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=batch, max_step_tokens=16))
    names = [w.new_adapter(eng) for _ in range(2)]
    seen = []
    real = eng.forward

    def forward(fb):
        seen.append(tuple(sorted({a or "" for a in fb.adapter_names})))
        return real(fb)

    eng.forward = forward
    eng.warm_up()
    assert ("",) in seen, f"no warm-up step without adapters: {sorted(set(seen))}"
    assert any(names[0] in s for s in seen)
    seen.clear()
    eng.warm_up([names[1]])  # no base model asked for: none served
    assert seen and all(s == (names[1],) for s in seen)
    assert not eng.has_work and w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_stop_ids_of_the_wrong_shape_name_the_fix_for_stop_ids():
    eng = _world().engine(SchedulerConfig())
    for stop, words in [(torch.tensor([[2, 3]]), r"flat"), (torch.tensor(2), r"\[id\] for one")]:
        with pytest.raises(ValueError, match="stop_ids") as e:
            eng.add_request([1, 2], None, stop_ids=stop)
        assert "prompt" not in str(e.value) and "add_requests" not in str(e.value), e.value
        assert e.match(words)
    assert not eng.has_work
    req = eng.add_request([1, 2], None, max_new_tokens=2, stop_ids=torch.tensor([[2, 3]])[0])
    assert req.stop_ids == (2, 3)
