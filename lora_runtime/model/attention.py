"""Grouped-query attention over the token-slot KV cache, written with torch ops only (no
host syncs, no data-dependent Python), so the same code runs eagerly and inside graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_runtime.engine.forward_batch import DecodeAttention, ExtendAttention, ForwardBatch
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.layers import RotaryEmbedding


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

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        k_cache, v_cache = kv.k[self.layer_idx], kv.v[self.layer_idx]
        k_cache.index_copy_(0, batch.out_cache_loc, k)
        v_cache.index_copy_(0, batch.out_cache_loc, v)
        if t == 0:
            out = q
        elif isinstance(batch.attn, DecodeAttention):
            out = self._decode(q, k_cache, v_cache, batch.attn)
        else:
            out = self._extend(q, k_cache, v_cache, batch.attn, batch.positions)
        return self.o_proj(out.reshape(t, self.q_size))

    def _decode(self, q, k_cache, v_cache, meta: DecodeAttention) -> torch.Tensor:
        bs, ctx = meta.kv_indices.shape
        g = self.num_heads // self.num_kv_heads
        k = k_cache[meta.kv_indices].permute(0, 2, 3, 1)  # [bs, KV, D, ctx]
        v = v_cache[meta.kv_indices].transpose(1, 2)  # [bs, KV, ctx, D]
        qg = q.view(bs, self.num_kv_heads, g, self.head_dim)
        scores = torch.matmul(qg, k).float() * self.scale  # [bs, KV, G, ctx]
        live = torch.arange(ctx, device=q.device)[None, :] < meta.kv_lens[:, None]
        scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(p, v).reshape(bs, self.num_heads, self.head_dim)

    def _extend(self, q, k_cache, v_cache, meta: ExtendAttention, positions) -> torch.Tensor:
        g = self.num_heads // self.num_kv_heads
        k = k_cache[meta.kv_indices].repeat_interleave(g, dim=1).transpose(0, 1)  # [H, C, D]
        v = v_cache[meta.kv_indices].repeat_interleave(g, dim=1).transpose(0, 1)
        mask = (meta.kv_req[None, :] == meta.token_req[:, None]) & (
            meta.kv_pos[None, :] <= positions[:, None]
        )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask[None, None], scale=self.scale,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)
