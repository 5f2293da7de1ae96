"""Neox-style rotary arithmetic shared by the RoPE + KV-write kernels (``kernels.rope_kv``
and ``kernels.rope_kv_windows``). Rounds like the torch reference: the tables to the model
dtype, then ``x * cos`` and ``rotate_half(x) * sin`` each rounded, then their sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_halves(lo, hi, cos, sin):
    dt = lo.dtype
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    new_lo = (lo32 * cos).to(dt).to(tl.float32) + (-hi32 * sin).to(dt).to(tl.float32)
    new_hi = (hi32 * cos).to(dt).to(tl.float32) + (lo32 * sin).to(dt).to(tl.float32)
    return new_lo.to(dt), new_hi.to(dt)


def q_out(qkv: torch.Tensor, k_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotated queries' output: ``[T, heads, head_dim]`` in qkv's dtype."""
    return qkv.new_empty((qkv.shape[0], heads, k_cache.shape[2]))
