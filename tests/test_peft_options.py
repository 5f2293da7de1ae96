"""PEFT adapter configs as trainers write them: options PEFT serves as plain LoRA load and
scale as PEFT does (a missing lora_alpha, bias='all' on a model without biases, tied-weight
targets, target_parameters, other architectures' names in target_modules), and saved base
embeddings are served only where they equal the model's (PEFT would serve its own)."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import ALL_TARGETS, make_runtime
from safetensors.torch import load_file, save_file

from lora_runtime.lora.adapters import (
    AdapterError,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.model.config import tiny

CFG = tiny()


def _saved(tmp_path, targets=("q_proj", "v_proj"), **config):
    path = tmp_path / "ad"
    save_peft_adapter(random_adapter(CFG, "ad", 4, targets, alpha=6.0, seed=5), path)
    cfg = json.loads((path / "adapter_config.json").read_text()) | config
    (path / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                          if v is not ...}))
    return path


def test_a_config_without_lora_alpha_scales_by_peft_s_default(tmp_path):
    ad = load_peft_adapter(_saved(tmp_path, lora_alpha=...))
    assert {m.scaling for m in ad.modules.values()} == {8 / 4}
    assert load_peft_adapter(_saved(tmp_path / "b")).modules[(0, "q_proj")].scaling == 6 / 4


def test_bias_all_without_bias_tensors_is_plain_lora(tmp_path):
    path = _saved(tmp_path, bias="all")
    assert len(load_peft_adapter(path).modules) == 2 * CFG.num_layers
    weights = load_file(str(path / "adapter_model.safetensors"))
    weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.ones(64)
    save_file(weights, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="is a bias; LoRA biases are not supported"):
        load_peft_adapter(path)


@pytest.mark.parametrize("config", [
    dict(target_modules=["embed_tokens"], ensure_weight_tying=True),
    dict(target_modules=[], target_parameters=["embed_tokens.weight", "lm_head.weight"]),
    dict(target_modules=["embed_tokens", "lm_head", "c_attn", "dense"]),
])
def test_targets_peft_accepts_are_accepted(tmp_path, config):
    ad = load_peft_adapter(_saved(tmp_path, ("embed_tokens", "lm_head"), **config))
    assert ad.targets == {"embed_tokens", "lm_head"}
    with pytest.raises(AdapterError, match="does not name 'lm_head'"):
        load_peft_adapter(_saved(tmp_path / "b", ("embed_tokens", "lm_head"),
                                 target_modules=["embed_tokens"]))


@pytest.mark.parametrize("dtype, scale, loads", [(torch.float32, 1.0, True),
                                                 (torch.bfloat16, 1.0, True),
                                                 (torch.float32, 1.008, False),
                                                 (torch.bfloat16, 1.02, False)])
def test_saved_base_embeddings_must_equal_the_model_s(tmp_path, dtype, scale, loads):
    runner = make_runtime(CFG, dtype=torch.float32, device="cpu", slots=1, max_rank=8,
                          targets=ALL_TARGETS)
    path = _saved(tmp_path, ("embed_tokens",), target_modules=["embed_tokens"])
    weights = load_file(str(path / "adapter_model.safetensors"))
    base = runner.model.model.embed_tokens.base.weight.detach()
    weights["base_model.model.model.embed_tokens.base_layer.weight"] = (base * scale).to(dtype)
    save_file(weights, str(path / "adapter_model.safetensors"))
    if loads:
        runner.lora.load_adapter("ad", path)
    else:
        with pytest.raises(AdapterError, match="differ from the model's"):
            runner.lora.load_adapter("ad", path)
        assert "ad" not in runner.lora.adapters


def test_saved_bf16_base_embeddings_load_on_an_fp16_model_of_them(tmp_path):
    """A bf16 checkpoint served in fp16: PEFT saved the adapter's embed_tokens base layer in
    bf16, the model holds its fp16 rounding. Neither dtype is coarser everywhere: below fp16's
    normal range (6.1e-5) fp16 rounds to multiples of 2**-24, so a tiny weight moves by more
    than a bf16 rounding of itself (a 32000 x 256 embedding ~N(0, 0.02) has ~600 such). They
    are one base; a copy that differs by more is still refused."""
    runner = make_runtime(CFG, dtype=torch.float16, device="cpu", slots=1, max_rank=8,
                          targets=ALL_TARGETS)
    g = torch.Generator().manual_seed(0)
    ckpt = (torch.randn(CFG.vocab_size, CFG.hidden_size, generator=g) * 0.02).to(torch.bfloat16)
    ckpt[5, :4] = torch.tensor([1e-7, -3e-7, 2e-6, -1e-6])  # fp16 subnormals
    runner.model.model.embed_tokens.base.weight.data.copy_(ckpt)  # the model's fp16 rounding
    for name, saved, loads in (("ad", ckpt, True), ("off", ckpt * 1.02, False)):
        path = _saved(tmp_path / name, ("embed_tokens",), target_modules=["embed_tokens"])
        weights = load_file(str(path / "adapter_model.safetensors"))
        weights["base_model.model.model.embed_tokens.base_layer.weight"] = saved
        save_file(weights, str(path / "adapter_model.safetensors"))
        if loads:
            runner.lora.load_adapter(name, path)
        else:
            with pytest.raises(AdapterError, match="differ from the model's"):
                runner.lora.load_adapter(name, path)
            assert name not in runner.lora.adapters
