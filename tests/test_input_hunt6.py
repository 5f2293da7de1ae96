"""Inputs an eighth hunt found unrefused or unnamed: a checkpoint tensor named under the wrong
block (``self_attn.gate_proj``) was written into gate_up's gate rows, replacing the real
weights, where it must be refused as not part of a Llama model; the consumer kernels named
neither a KV cache of the wrong rank (Python's unpacking error) nor a cache, norm weight or
residual on another device."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint_errors import CONFIG, _tensors

from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama


@pytest.mark.parametrize("stray, shape", [("model.layers.0.self_attn.gate_proj.weight", (32, 16)),
                                          ("model.layers.0.mlp.q_proj.weight", (16, 16))])
@pytest.mark.parametrize("own_file", [False, True])
def test_a_tensor_under_the_wrong_block_is_refused_not_loaded(tmp_path, stray, shape, own_file):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    weights, extra = _tensors(tied=False), {stray: torch.full(shape, 7.0)}
    if own_file:  # a later shard
        save_file(weights, str(tmp_path / "model-0.safetensors"))
        save_file(extra, str(tmp_path / "model-1.safetensors"))
    else:  # read after the real one: keys are read sorted
        save_file(weights | extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{stray}'"):
        load_hf_llama(tmp_path, torch.float32, "cpu")


def _rope_args():
    qkv, kc, vc = torch.randn(2, 32), torch.zeros(10, 1, 8), torch.zeros(10, 1, 8)
    return qkv, torch.tensor([0, 1]), torch.ones(16, 8), torch.zeros(16, 8), torch.tensor([3, 4]), \
        kc, vc


@pytest.mark.parametrize("change", [lambda c: c[:, 0], lambda c: c[None], lambda c: c.to("meta")])
def test_rope_names_a_kv_cache_of_the_wrong_rank_or_device(change):
    qkv, pos, cos, sin, loc, kc, vc = _rope_args()
    with pytest.raises(ValueError, match=r"k_cache/v_cache must be \[slots, kv_heads, head_dim\]"):
        rope_and_cache_kv(qkv, pos, cos, sin, loc, change(kc), change(vc), 2)


def test_rms_norm_names_a_weight_or_residual_on_another_device():
    x, w = torch.randn(3, 40), torch.ones(40)
    with pytest.raises(ValueError, match="weight must be .* on cpu"):
        rms_norm(x, w.to("meta"), 1e-5)
    with pytest.raises(ValueError, match="residual must match x .* on meta"):
        rms_norm(x, w, 1e-5, torch.randn(3, 40, device="meta"))
