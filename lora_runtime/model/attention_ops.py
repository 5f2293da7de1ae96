"""The attention a layer runs over the token-slot KV cache, by ``lora_runtime.model.backend``:
the Triton kernels (``kernels/decode_attention.py``, ``kernels/extend_attention.py``) or the
torch reference below."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention as decode_attention_triton
from kernels.extend_attention import extend_attention as extend_attention_triton
from lora_runtime.engine.forward_batch import DecodeAttention, ExtendAttention
from lora_runtime.model.backend import base_backend


def decode_attention(q, k_cache, v_cache, meta: DecodeAttention, scale: float) -> torch.Tensor:
    """``q [bs, heads, head_dim]`` -> ``[bs, heads, head_dim]``."""
    if base_backend(q.device, q.dtype) == "triton":
        return decode_attention_triton(q, k_cache, v_cache, meta.kv_indices, meta.kv_lens, scale)
    return decode_attention_reference(q, k_cache, v_cache, meta, scale)


def extend_attention(q, k_cache, v_cache, meta: ExtendAttention, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``q [T, heads, head_dim]`` (packed new tokens) -> ``[T, heads, head_dim]``."""
    if base_backend(q.device, q.dtype) == "triton":
        return extend_attention_triton(q, k_cache, v_cache, meta.kv_indices, meta.q_starts,
                                       meta.kv_starts, scale)
    return extend_attention_reference(q, k_cache, v_cache, meta, positions, scale)


def decode_attention_reference(q, k_cache, v_cache, meta: DecodeAttention,
                               scale: float) -> torch.Tensor:
    """Gathers each request's whole context (padded to the batch's) and computes in fp32."""
    bs, ctx = meta.kv_indices.shape
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k = k_cache[meta.kv_indices].permute(0, 2, 3, 1)  # [bs, KV, D, ctx]
    v = v_cache[meta.kv_indices].transpose(1, 2)  # [bs, KV, ctx, D]
    qg = q.view(bs, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(qg, k).float() * scale  # [bs, KV, G, ctx]
    live = torch.arange(ctx, device=q.device)[None, :] < meta.kv_lens[:, None]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(p, v).reshape(bs, heads, head_dim)


def extend_attention_reference(q, k_cache, v_cache, meta: ExtendAttention,
                               positions: torch.Tensor, scale: float) -> torch.Tensor:
    """A dense [T, C] mask over the whole packed batch: cost grows with its square."""
    g = q.shape[1] // k_cache.shape[1]
    k = k_cache[meta.kv_indices].repeat_interleave(g, dim=1).transpose(0, 1)  # [H, C, D]
    v = v_cache[meta.kv_indices].repeat_interleave(g, dim=1).transpose(0, 1)
    mask = (meta.kv_req[None, :] == meta.token_req[:, None]) & (
        meta.kv_pos[None, :] <= positions[:, None]
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=mask[None, None], scale=scale,
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)
