"""Adapters keyed, shaped or configured wrongly are refused with an AdapterError that names
the module or the config field, before anything reaches the pool."""

from __future__ import annotations

import json
import re

import pytest
import torch
from runtime_helpers import ALL_TARGETS, make_runtime
from safetensors.torch import load_file, save_file

from lora_runtime.lora.adapters import (
    AdapterError,
    ModuleLoRA,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.model.config import tiny

CFG = tiny()
H, V = CFG.hidden_size, CFG.vocab_size


def _adapter_with(key, module: ModuleLoRA):
    ad = random_adapter(CFG, "x", 4, ("o_proj",), seed=3)
    ad.modules[key] = module
    return ad


MISPLACED = {
    "per-layer module without a layer": (
        (None, "q_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), 1.0),
        "(None, 'q_proj'): q_proj sits in every decoder layer; key it (layer, 'q_proj')"),
    "lm_head given a layer": (
        (0, "lm_head"), ModuleLoRA(torch.randn(4, H), torch.randn(V, 4), 1.0),
        "(0, 'lm_head'): lm_head is a model-level module, not part of a decoder layer; "
        "key it (None, 'lm_head')"),
    "embed_tokens given a layer": (
        (1, "embed_tokens"), ModuleLoRA(torch.randn(4, V), torch.randn(H, 4), 1.0),
        "(1, 'embed_tokens'): embed_tokens is a model-level module"),
}
BAD_MODULES = {
    **MISPLACED,
    "layer past the model": (
        (2, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), 1.0),
        "layer 2 does not exist (the model has 2)"),
    "layer not an int": (
        ("0", "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), 1.0),
        "the layer must be an int, got str"),
    "0-D lora_A": (
        (0, "o_proj"), ModuleLoRA(torch.tensor(1.0), torch.randn(H, 1), 1.0),
        "model.layers.0.self_attn.o_proj: lora_A must be a 2-D tensor, got ()"),
    "1-D lora_B": (
        (1, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H), 1.0),
        "model.layers.1.self_attn.o_proj: lora_B must be a 2-D tensor, got (64,)"),
    "scaling None": (
        (0, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), None),
        "o_proj: scaling must be a finite number, got None"),
    "scaling NaN": (
        (0, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), float("nan")),
        "o_proj: scaling must be a finite number, got nan"),
    "scaling a bool": (
        (0, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.randn(H, 4), True),
        "o_proj: scaling must be a finite number, got True"),
    # An AttributeError ('tuple' object has no attribute 'a') named neither.
    "(A, B, scaling) tuple": (
        (0, "o_proj"), (torch.randn(4, H), torch.randn(H, 4), 1.0),
        "o_proj: expected a ModuleLoRA(a, b, scaling), got tuple"),
    # "Tensor.item() cannot be called on meta tensors", naming no module.
    "meta lora_B": (
        (1, "o_proj"), ModuleLoRA(torch.randn(4, H), torch.empty(H, 4, device="meta"), 1.0),
        "model.layers.1.self_attn.o_proj: lora_B is a meta tensor"),
}


@pytest.mark.parametrize("case", list(BAD_MODULES))
def test_validate_refuses_bad_module(case):
    key, module, msg = BAD_MODULES[case]
    with pytest.raises(AdapterError, match=re.escape("adapter 'x', ") + ".*" + re.escape(msg)):
        _adapter_with(key, module).validate(CFG, 8, ALL_TARGETS)


@pytest.mark.parametrize("case", list(MISPLACED))
def test_load_adapter_refuses_misplaced_module_and_leaves_pool(case):
    key, module, msg = MISPLACED[case]
    r = make_runtime(CFG, dtype=torch.float32, device=torch.device("cpu"), slots=2, max_rank=8)
    r.lora.load_adapter("resident", random_adapter(CFG, "resident", 4, ("o_proj",)), pinned=True)
    before = (sorted(r.lora.adapters), sorted(r.lora.images), dict(r.lora.pool.slot_of))
    with pytest.raises(AdapterError, match=re.escape(msg)):
        r.lora.load_adapter("x", _adapter_with(key, module))
    assert (sorted(r.lora.adapters), sorted(r.lora.images), dict(r.lora.pool.slot_of)) == before


def _saved(tmp_path):
    path = tmp_path / "x"
    save_peft_adapter(random_adapter(CFG, "x", 4, ("q_proj", "o_proj"), seed=3), path)
    return path


def _edit_config(path, **fields):
    f = path / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(fields)
    f.write_text(json.dumps(cfg))


MISPLACED_KEYS = {
    "lm_head in a layer": (
        "layers.0.self_attn.lm_head", (4, H), (V, 4),
        "puts lm_head in layer 0's self_attn, but lm_head sits at model level; expected "
        "'base_model.model.lm_head.lora_A.weight'"),
    "embed_tokens in a layer": (
        "base_model.model.model.layers.1.mlp.embed_tokens", (4, V), (H, 4),
        "puts embed_tokens in layer 1's mlp, but embed_tokens sits at model level"),
    "q_proj in the mlp": (
        "model.layers.0.mlp.q_proj", (4, H), (H, 4),
        "puts q_proj in layer 0's mlp, but q_proj sits in each layer's self_attn; expected "
        "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"),
}


@pytest.mark.parametrize("case", list(MISPLACED_KEYS))
def test_peft_key_at_the_wrong_level(tmp_path, case):
    prefix, a_shape, b_shape, msg = MISPLACED_KEYS[case]
    path = _saved(tmp_path)
    f = path / "adapter_model.safetensors"
    t = load_file(str(f))
    t[f"{prefix}.lora_A.weight"] = torch.randn(a_shape)
    t[f"{prefix}.lora_B.weight"] = torch.randn(b_shape)
    save_file(t, str(f))
    _edit_config(path, target_modules=list(ALL_TARGETS))
    with pytest.raises(AdapterError, match=re.escape("adapter_model.safetensors: key ") + ".*"
                       + re.escape(msg)):
        load_peft_adapter(path)


BAD_FIELDS = {
    "r true": ("r", True, "'r' must be a positive integer, got True"),
    "r float": ("r", 4.0, "'r' must be a positive integer, got 4.0"),
    "lora_alpha null": ("lora_alpha", None, "'lora_alpha' must be a finite number, got None"),
    "lora_alpha string": ("lora_alpha", "8", "'lora_alpha' must be a finite number, got '8'"),
    "lora_alpha true": ("lora_alpha", True, "'lora_alpha' must be a finite number, got True"),
    "lora_alpha an integer past float": (  # math.isfinite raised OverflowError
        "lora_alpha", 10**400, "'lora_alpha' must be a finite number, got 1000"),
    "alpha_pattern value an integer past float": (
        "alpha_pattern", {"o_proj": -(10**400)}, "alpha_pattern['o_proj'] must be a finite number"),
    "rank_pattern value string": (
        "rank_pattern", {"q_proj": "x"}, "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern value bool": (
        "rank_pattern", {"q_proj": True}, "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern bad regex": (
        "rank_pattern", {"q_proj(": 2}, "rank_pattern key 'q_proj(' is not a valid regex"),
    "rank_pattern a list": ("rank_pattern", [4], "'rank_pattern' must be an object"),
    "alpha_pattern value null": (
        "alpha_pattern", {"o_proj": None}, "alpha_pattern['o_proj'] must be a finite number"),
    "alpha_pattern bad regex": (
        "alpha_pattern", {"[o": 2.0}, "alpha_pattern key '[o' is not a valid regex"),
    "target_modules int": ("target_modules", 5, "target_modules must be a list of module names"),
    "target_modules of ints": (
        "target_modules", [5], "target_modules must be a list of module names"),
    "target_modules bad regex": (
        "target_modules", ".*(q_proj", "target_modules '.*(q_proj' is not a valid regex"),
    "use_rslora string": ("use_rslora", "false", "'use_rslora' must be true or false"),
    "use_dora string": ("use_dora", "no", "'use_dora' must be true or false"),
    "fan_in_fan_out int": ("fan_in_fan_out", 1, "'fan_in_fan_out' must be true or false"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_wrongly_typed_config_field(tmp_path, case):
    field, value, msg = BAD_FIELDS[case]
    path = _saved(tmp_path)
    _edit_config(path, **{field: value})
    with pytest.raises(AdapterError, match=re.escape(f"adapter_config.json: {msg}")):
        load_peft_adapter(path)


def test_optional_fields_null_or_per_module_still_load(tmp_path):
    path = _saved(tmp_path)
    _edit_config(path, r=4, lora_alpha=8, use_rslora=None, use_dora=None, alpha_pattern=None,
                 rank_pattern={"o_proj": 4}, target_modules=r".*\.(q_proj|o_proj)")
    ad = load_peft_adapter(path)
    ad.validate(CFG, 8, ALL_TARGETS)
    assert {m.scaling for m in ad.modules.values()} == {2.0}
    assert ad.targets == {"q_proj", "o_proj"} and not ad.use_rslora
