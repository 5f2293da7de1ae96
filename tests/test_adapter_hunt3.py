"""Adapter loading and the slot pool, third hunt: pin flags that are not bools, a
``LoRAConfig.target_modules`` that could change (or be used up) after the manager wrapped the
model, failed loads leaving the pool exactly as it was (LRU clock and version included), and
unusual PEFT configs giving PEFT's own logits."""

from __future__ import annotations

import copy

import pytest
import torch
from peft_parity import assert_serves_peft_logits, save_random_lora
from runtime_helpers import make_runtime

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import AdapterError, random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CFG = tiny()
CPU = torch.device("cpu")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _runner(slots=2):
    r = make_runtime(CFG, dtype=torch.float32, device=CPU, slots=slots, max_rank=8,
                     targets=LINEAR)
    r.lora.load_adapter("resident", random_adapter(CFG, "resident", 4, seed=1), pinned=True)
    r.lora.load_adapter("other", random_adapter(CFG, "other", 8, seed=2))
    reqs = [Request([1, 2, 3], "other")]
    r.forward_eager(build_extend(reqs, r.kv, CPU))  # "other" takes a slot, the clock moves
    release(reqs, r.kv)
    return r


def _state(lora):
    """Everything a load may change: names, images, slots, pins, LRU clock, pool version,
    the prepared batch and every slot's weights, ranks and scalings."""
    p = lora.pool
    return dict(
        adapters={k: id(v) for k, v in lora.adapters.items()},
        images={k: id(v) for k, v in lora.images.items()}, fingerprints=dict(lora.fingerprints),
        owner=list(p.owner), slot_of=dict(p.slot_of), pinned=set(p.pinned),
        last_use=dict(p._last_use), clock=p._clock, version=p.version,
        in_batch=set(lora._in_batch), batch_info=id(lora.backend.batch_info),
        weights=[t.clone() for w in lora.weights.values()
                 for t in (w.lora_a, w.lora_b, w.ranks, w.scalings)],
    )


def _assert_same(lora, before):
    after = _state(lora)
    for key in before:
        if key == "weights":
            assert all(torch.equal(a, b) for a, b in zip(before[key], after[key], strict=True)), (
                "slot weights changed")
        else:
            assert after[key] == before[key], f"{key} changed: {before[key]} -> {after[key]}"


# -- pin flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["no", "false", 1, None])
def test_load_adapter_refuses_a_pinned_flag_that_is_not_a_bool(flag):
    """``load_adapter(name, src, pinned="no")`` pinned the adapter (a slot taken for good,
    an LRU victim evicted) by the flag's truthiness; ``pinned=None`` loaded it unpinned."""
    r = _runner()
    before = _state(r.lora)
    with pytest.raises(AdapterError, match=r"adapter 'x': pinned must be True or False, got"):
        r.lora.load_adapter("x", random_adapter(CFG, "x", 2, seed=3), pinned=flag)
    _assert_same(r.lora, before)


@pytest.mark.parametrize("flag", ["no", 0.0, 1])
def test_manager_pin_adapter_refuses_a_flag_that_is_not_a_bool(flag):
    """``LoRAManager.pin_adapter(name, "no")`` pinned (``0.0`` unpinned): the engine refused
    such flags, the manager it calls did not."""
    r = _runner()
    before = _state(r.lora)
    with pytest.raises(ValueError, match=r"pinned must be True or False"):
        r.lora.pin_adapter("other", flag)
    with pytest.raises(ValueError, match=r"pinned must be True or False"):
        r.lora.pin_adapter("resident", flag)
    _assert_same(r.lora, before)


# -- LoRAConfig.target_modules -------------------------------------------------------------

def _manager(targets):
    model = LlamaForCausalLM.random(CFG, torch.float32, CPU, seed=0)
    lora = LoRAManager(model, LoRAConfig(2, 8, targets, "torch"))
    return ModelRunner(model, KVCache(CFG, 128, torch.float32, CPU), lora)


def test_a_target_list_changed_after_the_manager_was_built_does_not_admit_adapters():
    """The config kept the caller's list: appending ``o_proj`` after the manager wrapped only
    qkv let an o_proj adapter past validation, and its load failed deep in the slot image
    with a bare ``KeyError: (0, 'o_proj', 'a')`` (under DP its o_proj weights were dropped)."""
    targets = ["q_proj", "v_proj"]
    r = _manager(targets)
    targets.append("o_proj")
    assert r.lora.config.target_modules == ("q_proj", "v_proj")
    hash(r.lora.config)  # a frozen config is hashable again
    before = _state(r.lora)
    with pytest.raises(AdapterError, match=r"without LoRA on 'o_proj'.*Add it to "
                                           r"LoRAConfig\.target_modules"):
        r.lora.load_adapter("o", random_adapter(CFG, "o", 4, ("o_proj",)))
    _assert_same(r.lora, before)


def test_target_modules_given_as_a_generator_are_all_kept():
    """A generator was used up by the config's own check: the manager wrapped no module and
    refused every adapter naming ``targets: []``."""
    r = _manager(t for t in ("q_proj", "o_proj"))
    assert r.lora.config.target_modules == ("q_proj", "o_proj")
    assert {k[1] for k in r.lora.weights} == {"qkv_proj", "o_proj"}
    r.lora.load_adapter("o", random_adapter(CFG, "o", 4, ("o_proj",)))


@pytest.mark.parametrize("value", [None, 3, [1]])
def test_target_modules_that_are_not_module_names_are_refused(value):
    with pytest.raises(ValueError, match=r"LoRAConfig\.target_modules must be a tuple of module"):
        LoRAConfig(2, 8, value, "torch")


# -- failed loads leave the pool exactly as it was (guards; these held) ---------------------

def test_failed_loads_leave_clock_version_and_slots_as_they_were():
    r = _runner(slots=2)
    bad_rank = random_adapter(CFG, "big", 16)
    bad_shape = random_adapter(CFG, "s", 4, ("o_proj",))
    bad_shape.modules[(0, "o_proj")].b = bad_shape.modules[(0, "o_proj")].b[:-1]
    r.lora.load_adapter("third", random_adapter(CFG, "third", 2, seed=4))
    r.lora.pin_adapter("other")  # every slot pinned: a pinned load has nowhere to go
    before = _state(r.lora)
    for name, src, pinned, words in [
        ("big", bad_rank, True, "rank 16 exceeds max_rank 8"),
        ("s", bad_shape, True, "lora_B has shape"),
        ("y", random_adapter(CFG, "y", 2), True, "cannot pin 'y'"),
        ("other", random_adapter(CFG, "other", 2), False, "already loaded"),
        ("z", None, False, "source must be"),
        ("", random_adapter(CFG, "e", 2), False, "must not be empty"),
    ]:
        with pytest.raises(AdapterError, match=words):
            r.lora.load_adapter(name, src, pinned=pinned)
        _assert_same(r.lora, before)


# -- unusual PEFT configs against PEFT itself (guards; these held) ---------------------------

PEFT_CONFIGS = {
    # rank_pattern keys that are regexes, one an alternation PEFT matches as (.*\.)?(a|b)$
    "regex patterns": dict(target_modules="all-linear",
                           rank_pattern={r"layers\.1\..*": 2, "q_proj|v_proj": 6},
                           alpha_pattern={r"model\.layers\.0\.mlp\..*": 3}),
    "rslora + patterns": dict(use_rslora=True, target_modules="all-linear",
                              rank_pattern={"down_proj": 7}, alpha_pattern={"k_proj": 1.5}),
    "regex target_modules on one layer": dict(
        target_modules=r".*layers\.1\.self_attn\.(q|v)_proj"),
    "layers_to_transform + bias=all": dict(target_modules=["q_proj", "up_proj"],
                                           layers_to_transform=[1], bias="all"),
    "exclude_modules": dict(target_modules="all-linear", exclude_modules=["down_proj"]),
    "MiCA init (plain LoRA forward)": dict(target_modules=["embed_tokens", "q_proj"],
                                           init_lora_weights="mica"),
    "empty aLoRA tokens (plain LoRA)": dict(target_modules=["o_proj"],
                                            alora_invocation_tokens=[]),
}


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hunt3")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "base")
    return root, model


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(PEFT_CONFIGS))
def test_unusual_peft_configs_give_peft_s_logits(hf_base, case):

    peft = pytest.importorskip("peft")
    root, model = hf_base
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, **PEFT_CONFIGS[case])).eval()
    save_random_lora(pm, root / case)
    assert_serves_peft_logits(pm, root / "base", root / case, 8, msg=case)
