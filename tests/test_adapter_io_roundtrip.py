"""``save_peft_adapter`` is faithful: an adapter with per-module ranks and scalings, saved and
read back, has the same modules, ranks, scalings (bit for bit) and weights; the config it
writes is one PEFT reads the same way (checked against PEFT itself where it is installed)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from runtime_helpers import ALL_TARGETS
from safetensors.torch import load_file, save_file

from lora_runtime.lora.adapters import (
    AdapterError,
    LoRAAdapter,
    ModuleLoRA,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.model.config import tiny
from lora_runtime.model.modules import module_path

CFG = tiny()
RANKS = {"q_proj": 2, "k_proj": 3, "v_proj": 4, "o_proj": 5, "gate_proj": 6, "up_proj": 7,
         "down_proj": 8, "embed_tokens": 3, "lm_head": 4}


def _mixed(use_rslora: bool, seed: int = 0) -> LoRAAdapter:
    """Every target at its own rank and alpha; layer 1's o_proj at yet another scaling."""
    modules = {}
    for i, (target, rank) in enumerate(RANKS.items()):
        part = random_adapter(CFG, target, rank, (target,), alpha=1.7 + i * 0.9,
                              use_rslora=use_rslora, seed=seed + i)
        modules |= part.modules
    modules[(1, "o_proj")].scaling = 0.1
    return LoRAAdapter("mixed", modules, 4, 8.0, use_rslora, tuple(RANKS))


def _assert_same(got: LoRAAdapter, want: LoRAAdapter) -> None:
    assert got.modules.keys() == want.modules.keys()
    for key, m in want.modules.items():
        g = got.modules[key]
        assert (g.rank, g.scaling) == (m.rank, m.scaling), key
        assert torch.equal(g.a, m.a) and torch.equal(g.b, m.b), key
    assert got.use_rslora == want.use_rslora
    assert got.base_layers.keys() == want.base_layers.keys()
    for target, t in want.base_layers.items():
        assert torch.equal(got.base_layers[target], t)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_per_module_ranks_and_scalings_round_trip(tmp_path, use_rslora):
    """The config carried the adapter's r and lora_alpha only: a v_proj of rank 4 beside
    r=4 loaded, a q_proj of rank 2 was refused ('do not have rank 4'), and a module whose
    scaling was not lora_alpha / r came back at lora_alpha / r."""
    ad = _mixed(use_rslora)
    ad.base_layers["embed_tokens"] = torch.randn(CFG.vocab_size, CFG.hidden_size)
    save_peft_adapter(ad, tmp_path / "m")
    back = load_peft_adapter(tmp_path / "m")
    _assert_same(back, ad)
    back.validate(CFG, 8, ALL_TARGETS)
    save_peft_adapter(back, tmp_path / "again")  # and once more, from what was read
    _assert_same(load_peft_adapter(tmp_path / "again"), ad)


def test_scalings_set_per_module_round_trip_exactly(tmp_path):
    """Scalings of the form alpha / r (or / sqrt(r)) for any alpha, each module its own,
    come back bit for bit. A scaling that no float alpha gives (0.1 at rank 3: 0.3 / 3 and
    its neighbour miss it) comes back as the nearest one PEFT can express, within an ulp."""
    g = torch.Generator().manual_seed(1)
    for rslora in (False, True):
        modules = {}
        for layer in range(CFG.num_layers):
            for target, rank in (("q_proj", 3), ("o_proj", 5), ("down_proj", 7)):
                m = random_adapter(CFG, "x", rank, (target,), seed=layer).modules[(layer, target)]
                alpha = float(torch.rand((), generator=g, dtype=torch.float64)) * 50
                m.scaling = alpha / (math.sqrt(rank) if rslora else rank)
                modules[(layer, target)] = m
        ad = LoRAAdapter("x", modules, 3, 1.0, rslora)
        save_peft_adapter(ad, tmp_path / str(rslora))
        _assert_same(load_peft_adapter(tmp_path / str(rslora)), ad)
    ad = random_adapter(CFG, "x", 3, ("q_proj",))
    ad.modules[(0, "q_proj")].scaling = 0.1
    save_peft_adapter(ad, tmp_path / "ulp")
    got = load_peft_adapter(tmp_path / "ulp").modules[(0, "q_proj")].scaling
    assert abs(got - 0.1) <= math.ulp(0.1)


def test_an_adapter_read_from_peft_keeps_its_own_patterns(tmp_path):
    """Where the adapter's r, lora_alpha and patterns give each module its rank and scaling,
    they are written as they were (no per-module expansion)."""
    patterns = dict(rank_pattern={"q_proj": 2, r"layers\.1\.self_attn\.o_proj": 6},
                    alpha_pattern={"o_proj": 3.5})
    path = tmp_path / "peft"
    save_peft_adapter(random_adapter(CFG, "x", 4, ("q_proj", "o_proj")), path)
    cfg = json.loads((path / "adapter_config.json").read_text()) | patterns
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    w = load_file(str(path / "adapter_model.safetensors"))
    for layer in range(CFG.num_layers):
        p = f"base_model.model.model.layers.{layer}.self_attn"
        w[f"{p}.q_proj.lora_A.weight"] = torch.randn(2, CFG.hidden_size)
        w[f"{p}.q_proj.lora_B.weight"] = torch.randn(CFG.hidden_size, 2)
    w[f"{p}.o_proj.lora_A.weight"] = torch.randn(6, CFG.hidden_size)
    w[f"{p}.o_proj.lora_B.weight"] = torch.randn(CFG.hidden_size, 6)
    save_file(w, str(path / "adapter_model.safetensors"))
    ad = load_peft_adapter(path)
    save_peft_adapter(ad, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert {k: again[k] for k in patterns} == patterns
    assert (again["r"], again["lora_alpha"]) == (4, 8.0)
    _assert_same(load_peft_adapter(tmp_path / "again"), ad)


def test_a_target_on_some_layers_only_is_saved_for_those_layers(tmp_path):
    """target_modules ['q_proj'] would make PEFT wrap every layer's q_proj (and report the
    layers without weights as missing keys): the saved regex names the modules there are."""
    ad = random_adapter(CFG, "x", 4, ("q_proj", "o_proj", "lm_head"), seed=2)
    del ad.modules[(1, "q_proj")]
    save_peft_adapter(ad, tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], str)
    names = [module_path(*k) for k in ad.modules] + [module_path(1, "q_proj")]
    assert [n for n in names if re.fullmatch(cfg["target_modules"], n)] == names[:-1]
    _assert_same(load_peft_adapter(tmp_path / "x"), ad)
    full = random_adapter(CFG, "y", 4, ("q_proj", "lm_head"), seed=2)
    save_peft_adapter(full, tmp_path / "y")
    cfg = json.loads((tmp_path / "y" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["lm_head", "q_proj"]


def test_saving_an_adapter_whose_a_and_b_ranks_differ_is_refused(tmp_path):
    ad = random_adapter(CFG, "x", 4, ("o_proj",))
    ad.modules[(1, "o_proj")] = ModuleLoRA(torch.randn(4, CFG.hidden_size),
                                           torch.randn(CFG.hidden_size, 3), 1.0)
    with pytest.raises(AdapterError, match=r"layers\.1\.self_attn\.o_proj: lora_A / lora_B "
                                           r"must be 2-D of one rank >= 1.*\(4, 64\) / \(64, 3\)"):
        save_peft_adapter(ad, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _peft_model(path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size, num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads, num_key_value_heads=CFG.num_kv_heads,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf)
    return peft.PeftModel.from_pretrained(base, str(path)).base_model.model


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_reads_the_saved_config_as_this_runtime_does(tmp_path, use_rslora):
    ad = _mixed(use_rslora, seed=3)
    del ad.modules[(0, "gate_proj")]
    save_peft_adapter(ad, tmp_path / "m")
    model = _peft_model(tmp_path / "m")
    wrapped = {name for name, mod in model.named_modules() if hasattr(mod, "lora_A")}
    assert wrapped == {module_path(*k) for k in ad.modules}
    for (layer, target), m in ad.modules.items():
        mod = model.get_submodule(module_path(layer, target))
        assert (mod.r["default"], mod.scaling["default"]) == (m.rank, m.scaling), (layer, target)
        if target == "embed_tokens":
            a, b = mod.lora_embedding_A["default"], mod.lora_embedding_B["default"]
        else:
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        assert torch.equal(a, m.a) and torch.equal(b, m.b), (layer, target)
