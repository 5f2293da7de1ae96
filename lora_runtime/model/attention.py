"""The Llama attention layer: qkv projection, RoPE with K/V written to the token-slot cache
(one fused step), then grouped-query attention over the cache (``attention_ops``: Triton
kernels or the torch reference), then the output projection. No host syncs, no data-dependent
Python, so the same code runs eagerly and inside graphs."""

from __future__ import annotations

import torch
from torch import nn

from lora_runtime.engine.forward_batch import DecodeAttention, ForwardBatch
from lora_runtime.model.attention_ops import decode_attention, extend_attention
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.layers import RotaryEmbedding, deferred


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary  # shared by every layer
        self.scale = self.head_dim**-0.5

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv):
        """``(output, LoRA term or None)``: a LoRA o_proj may leave its term to the norm after
        it (``DeferredExpandLinear.forward_deferred``)."""
        t = hidden.shape[0]
        k_cache, v_cache = kv.k[self.layer_idx], kv.v[self.layer_idx]
        qkv, lora = deferred(self.qkv_proj, hidden)
        q = self.rotary.rotate_and_cache(qkv, batch.positions, batch.out_cache_loc, k_cache,
                                         v_cache, self.num_heads, lora)
        if t == 0:
            out = q
        elif isinstance(batch.attn, DecodeAttention):
            out = decode_attention(q, k_cache, v_cache, batch.attn, self.scale)
        else:
            out = extend_attention(q, k_cache, v_cache, batch.attn, batch.positions, self.scale)
        return deferred(self.o_proj, out.reshape(t, self.q_size))
