"""Adapter loading, fifth hunt: PEFT adapter folders as PEFT writes them for unusual options."""

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
WEIGHTS = "adapter_model.safetensors"


def _with_tensors(path, tensors: dict):
    weights = load_file(str(path / WEIGHTS)) | tensors
    save_file(weights, str(path / WEIGHTS))
    return path


def test_embeddings_saved_without_base_layer_are_base_layers(tmp_path):
    """save_pretrained(..., save_embedding_layers=True) on an adapter that does not target the
    embeddings saves them as ``model.embed_tokens.weight`` / ``lm_head.weight`` (no
    ``base_layer``; PEFT loads them over the model's): they were refused as unrecognised keys.
    Equal to the model's they serve as plain LoRA; a changed copy is refused."""
    runner = make_runtime(CFG, dtype=torch.float32, device="cpu", slots=1, max_rank=8,
                          targets=ALL_TARGETS)
    embed = runner.model.model.embed_tokens.base.weight.detach().clone()
    head = runner.model.lm_head.base.weight.detach().clone()
    for name, scale, loads in (("same", 1.0, True), ("resized", 1.5, False)):
        path = tmp_path / name
        save_peft_adapter(random_adapter(CFG, name, 4, ("q_proj",), seed=3), path)
        _with_tensors(path, {"base_model.model.model.embed_tokens.weight": embed * scale,
                             "base_model.model.lm_head.weight": head})
        if loads:
            runner.lora.load_adapter(name, path)
            assert set(runner.lora.adapters[name].base_layers) == {"embed_tokens", "lm_head"}
        else:
            with pytest.raises(AdapterError, match="embed_tokens weights that differ"):
                runner.lora.load_adapter(name, path)
            assert name not in runner.lora.adapters
    path = _with_tensors(tmp_path / "same", {
        "base_model.model.model.embed_tokens.base_layer.weight": embed})
    with pytest.raises(AdapterError, match="name the same tensor"):
        runner.lora.load_adapter("both", path)


def test_a_config_without_r_ranks_by_peft_s_default(tmp_path):
    """PEFT reads a config without ``r`` as LoraConfig's default, 8 (as it does a missing
    lora_alpha, which was already served so): it was refused as "'r' ... got None"."""
    for rank in (8, 4):
        path = tmp_path / f"r{rank}"
        save_peft_adapter(random_adapter(CFG, "ad", rank, ("q_proj",), alpha=6.0), path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        del cfg["r"]
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        if rank == 8:
            ad = load_peft_adapter(path)
            assert ad.r == 8 and {m.scaling for m in ad.modules.values()} == {6 / 8}
        else:
            with pytest.raises(AdapterError, match="gives this module rank 8: set r"):
                load_peft_adapter(path)


@pytest.mark.parametrize("absent", [True, False])
def test_a_config_without_target_modules_targets_peft_s_llama_default(tmp_path, absent):
    """PEFT reads target_modules absent or null as its default for Llama, q_proj and v_proj:
    such a config was refused ("target_modules is missing", no fix named)."""
    for targets in (("q_proj", "v_proj"), ("q_proj", "k_proj")):
        path = tmp_path / "_".join(targets)
        save_peft_adapter(random_adapter(CFG, "ad", 4, targets, alpha=6.0), path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        if absent:
            del cfg["target_modules"]
        else:
            cfg["target_modules"] = None
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        if "k_proj" in targets:
            with pytest.raises(AdapterError, match=r"target_modules \['q_proj', 'v_proj'\] "
                                                   "does not name 'k_proj'"):
                load_peft_adapter(path)
        else:
            assert load_peft_adapter(path).targets == {"q_proj", "v_proj"}
