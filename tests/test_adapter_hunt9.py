"""Adapters and the LoRA manager, ninth hunt: a PEFT config with fan_in_fan_out=true (PEFT
resets it on Llama's nn.Linear targets and serves plain LoRA) was refused; save_peft_adapter
wrote the weights before the config failed to serialise (a numpy alpha, a Path base_model),
leaving new weights beside the folder's old config; a Triton-backend manager wrapped a
float64 model, whose first LoRA forward then failed inside a launch."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import (
    AdapterError,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.lora.layers import LoRALayer
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CFG = tiny(1)
CPU = torch.device("cpu")


@pytest.mark.filterwarnings("ignore")
def test_fan_in_fan_out_true_is_served_as_peft_serves_it(tmp_path):
    """PEFT warns and sets fan_in_fan_out back to false on nn.Linear (its embedding forward
    never reads it): a Llama adapter whose config says true is plain LoRA. It was refused as
    "for Conv1D models"."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from lora_runtime.model.checkpoint import load_hf_llama
    from lora_runtime.model.modules import BY_NAME

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "down_proj", "embed_tokens"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(tmp_path / "ad")
    cfg_file = tmp_path / "ad" / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"fan_in_fan_out": True}))
    want_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ad").eval()

    ours = LoRAManager(load_hf_llama(tmp_path / "base", torch.float32, CPU),
                       LoRAConfig(1, 4, tuple(BY_NAME), "torch"))
    ours.load_adapter("a", tmp_path / "ad")
    runner = ModelRunner(ours.model, KVCache(ours.model.config, 32, torch.float32, CPU), ours)
    prompt = [3, 17, 99, 5, 120]
    reqs = [Request(prompt, "a", 1)]
    got = runner.forward_eager(build_extend(reqs, runner.kv, CPU))[0]
    release(reqs, runner.kv)
    with torch.no_grad():
        want = want_model(torch.tensor([prompt])).logits[0, -1]
        base = hf(torch.tensor([prompt])).logits[0, -1]
    assert (want - base).abs().max() > 0.05  # the adapter does something
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fan_in_fan_out_must_still_be_a_flag(tmp_path):
    save_peft_adapter(random_adapter(CFG, "x", 2, ("q_proj",), seed=1), tmp_path)
    cfg_file = tmp_path / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"fan_in_fan_out": "yes"}))
    with pytest.raises(AdapterError, match="'fan_in_fan_out' must be true or false"):
        load_peft_adapter(tmp_path)


def _scalings(ad):
    return {k: float(m.scaling) for k, m in ad.modules.items()}


def test_a_save_writes_numpy_values_and_a_path_or_nothing(tmp_path):
    """The weights were written first, then json.dumps raised on a numpy float alpha or a
    Path base_model: over an earlier save of the same folder, the new weights then loaded
    with the old config's scalings."""
    folder = tmp_path / "ad"
    first = random_adapter(CFG, "x", 4, ("q_proj", "o_proj"), alpha=8.0, seed=1)
    save_peft_adapter(first, folder)
    second = random_adapter(CFG, "x", 4, ("q_proj", "o_proj"), alpha=2.0, seed=2)
    second = dataclasses.replace(second, alpha=np.float32(2.0),
                                 alpha_pattern={"o_proj": np.float32(2.0)})
    save_peft_adapter(second, folder, base_model=Path("/models/llama"))
    back = load_peft_adapter(folder)
    assert _scalings(back) == _scalings(second)
    assert json.loads((folder / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "/models/llama"

    third = random_adapter(CFG, "x", 4, ("q_proj", "o_proj"), alpha=5.0, seed=3)
    with pytest.raises(AdapterError, match="base_model must be the base model's name or path"):
        save_peft_adapter(third, folder, base_model=5)
    back = load_peft_adapter(folder)  # the folder as the last good save left it
    assert _scalings(back) == _scalings(second)
    assert all(torch.equal(back.modules[k].a, m.a) for k, m in second.modules.items())


def test_a_triton_manager_refuses_a_model_in_a_dtype_its_kernels_do_not_take():
    """A float64 model (a reference) was wrapped; its first forward with an adapter failed
    in a kernel launch with "y has dtype torch.float64; expected fp16, bf16 or fp32"."""
    model = LlamaForCausalLM.random(CFG, torch.float64, CPU, seed=0)
    with pytest.raises(ValueError, match=r"backend='triton'\) cannot serve a torch\.float64 "
                                         r"model .* use LoRAConfig\(backend='torch'\)"):
        LoRAManager(model, LoRAConfig(2, 4, ("q_proj",), "triton"))
    assert not any(isinstance(m, LoRALayer) for m in model.modules())
    LoRAManager(model, LoRAConfig(2, 4, ("q_proj",), "torch"))  # the fix it names


@pytest.mark.parametrize("key, value, fix", [
    ("use_dora", True, r"merge_and_unload\(\)\) and serve the merged model, or retrain it with "
                       "use_dora=false"),
    ("modules_to_save", ["lm_head"], r"merge_and_unload\(\).*, or retrain with those modules "
                                     "in target_modules instead"),
    ("lora_bias", True, "retrain the adapter without lora_bias"),
], ids=["use_dora", "modules_to_save", "lora_bias"])
def test_refused_peft_options_name_the_field_and_a_fix(tmp_path, key, value, fix):
    """The refusals named the option but no way out ("DoRA adapters are not supported")."""
    save_peft_adapter(random_adapter(CFG, "x", 2, ("q_proj",), seed=1), tmp_path)
    cfg_file = tmp_path / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {key: value}))
    with pytest.raises(AdapterError, match=f"{key}.*{fix}"):
        load_peft_adapter(tmp_path)
