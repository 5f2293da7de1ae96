"""RoPE with the KV write and qkv's pending LoRA term, by windows of permuted rows.

A by-rows program (``kernels.rope_kv``) adds one token's term to one head: each token reads
its adapter's B columns alone, and past a few dozen rows that is the cost (256 rows at rank
64: ~200 MB of B reads a layer). A program here covers ``FUSE_BLOCK_M`` consecutive rows of the
layout's permutation (a window: rows sorted by slot, so few distinct slots) and one head: it
adds the head's term to the window's rows (``lora_delta``: one ``tl.dot`` per distinct slot of
the window, B's head columns read once a window), rotates q and k, and writes q, and k and v
into each row's cache slot. In a graph at and past ``config.PENDING_WINDOWS_MIN_ROWS["rope"]``
rows this replaces qkv's separate expand (a launch after the GEMM and a read-modify-write of
its output); eager, it replaces the by-rows term.

Every row of the forward is covered (padding rows of a static view and rows of the neutral
slot: their term is zero), each by exactly one program per head: the permutation holds every
row once. Positions and cache slots are gathered per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.lora_epilogue import FUSE_BLOCK_M, block_a, lora_delta, lora_rows
from kernels.rotary import q_out, rotate_halves
from kernels.traced_op import traced_op


@triton.jit
def _head_with_term(qkv_ptr, rows, stride_qkv, col, half, offs_d, d_mask, mask, a, b_ptr,
                    ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn, stride_br, slots, sl,
                    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """Halves (lo, hi) ``[BLOCK_M, BLOCK_HALF]`` of the head at qkv column ``col`` for
    ``rows``, slice ``sl``'s term added and rounded as the expand rounds it."""
    ptr = qkv_ptr + rows[:, None] * stride_qkv + col + offs_d[None, :]
    lora = (b_ptr, ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn, stride_br, slots)
    lo = tl.load(ptr, mask=mask, other=0.0)
    hi = tl.load(ptr + half, mask=mask, other=0.0)
    lo = (lo.to(tl.float32) + lora_delta(a, *lora, col + offs_d, d_mask, sl, NUM_SLICES,
                                         BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)).to(lo.dtype)
    hi = (hi.to(tl.float32) + lora_delta(a, *lora, col + half + offs_d, d_mask, sl,
                                         NUM_SLICES, BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)
          ).to(lo.dtype)
    return lo, hi


@triton.jit
def _rope_kv_lora_windows_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, loc_ptr, q_ptr, k_ptr, v_ptr, n_rows,
    a_ptr, b_ptr, perm_ptr, slots_ptr, ranks_ptr, scal_ptr,
    heads: tl.constexpr, kv_heads: tl.constexpr, half: tl.constexpr,
    stride_qkv: tl.constexpr, stride_q: tl.constexpr, stride_k: tl.constexpr,
    stride_v: tl.constexpr, stride_tab: tl.constexpr, max_rank: tl.constexpr,
    sentinel: tl.constexpr, stride_am: tl.constexpr, stride_ar: tl.constexpr,
    stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (windows, heads + kv_heads): the first ``heads`` programs of a window rotate a q
    head each; the others rotate a k head and copy its v head into the caches. Shapes and
    strides fixed for a model are compile-time (the launcher's per-argument host cost)."""
    rows, m_mask, slots = lora_rows(perm_ptr, slots_ptr, tl.program_id(0) * BLOCK_M, n_rows,
                                    sentinel, BLOCK_M)
    p = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    mask = m_mask[:, None] & d_mask[None, :]
    pos = tl.load(pos_ptr + rows, mask=m_mask, other=0).to(tl.int64)
    tab = pos[:, None] * stride_tab + offs_d[None, :]
    dt = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(dt).to(tl.float32)
    head = (qkv_ptr, rows, stride_qkv)
    lora = (b_ptr, ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn, stride_br, slots)
    if p < heads:
        a = block_a(a_ptr, rows, m_mask, 0, max_rank, stride_am, stride_ar, BLOCK_R)
        lo, hi = _head_with_term(*head, p * 2 * half, half, offs_d, d_mask, mask, a, *lora, 0,
                                 3, BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)
        lo, hi = rotate_halves(lo, hi, cos, sin)
        out = q_ptr + rows[:, None] * stride_q + p * 2 * half + offs_d[None, :]
        tl.store(out, lo, mask=mask)
        tl.store(out + half, hi, mask=mask)
    else:
        j = p - heads
        cache = tl.load(loc_ptr + rows, mask=m_mask, other=0).to(tl.int64)[:, None]
        a = block_a(a_ptr, rows, m_mask, 1, max_rank, stride_am, stride_ar, BLOCK_R)
        lo, hi = _head_with_term(*head, (heads + j) * 2 * half, half, offs_d, d_mask, mask, a,
                                 *lora, 1, 3, BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)
        lo, hi = rotate_halves(lo, hi, cos, sin)
        out = k_ptr + cache * stride_k + j * 2 * half + offs_d[None, :]
        tl.store(out, lo, mask=mask)
        tl.store(out + half, hi, mask=mask)
        a = block_a(a_ptr, rows, m_mask, 2, max_rank, stride_am, stride_ar, BLOCK_R)
        lo, hi = _head_with_term(*head, (heads + kv_heads + j) * 2 * half, half, offs_d, d_mask,
                                 mask, a, *lora, 2, 3, BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)
        out = v_ptr + cache * stride_v + j * 2 * half + offs_d[None, :]
        tl.store(out, lo, mask=mask)
        tl.store(out + half, hi, mask=mask)


@traced_op("multilora::rope_and_cache_kv_lora_windows", mutates_args=("k_cache", "v_cache"))
def rope_kv_lora_windows_op(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    cache_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
    src: torch.Tensor, b: torch.Tensor, perm: torch.Tensor, slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, sentinel: int, s_sm: int,
    s_sr: int, s_bs: int, s_bn: int, s_br: int, la: torch.Tensor, K: int, s_as: int,
    s_ar: int, s_ak: int, NUM_SLICES: int, BLOCK_R: int, PRECISION: str, SHRINK: bool,
    BLOCK_K: int,
) -> torch.Tensor:
    """Rotated ``q``; k and v written to the caches. The term's arguments are
    ``kernels.row_lora.block_args``'s for a pending term (``src`` is ``a``; three slices)."""
    if SHRINK or NUM_SLICES != 3:
        raise ValueError("rope_kv_lora_windows_op takes a pending qkv term (three slices, "
                         f"SHRINK False), got NUM_SLICES={NUM_SLICES} SHRINK={SHRINK}")
    q = q_out(qkv, k_cache, heads)
    t, kv_heads, half = qkv.shape[0], k_cache.shape[1], k_cache.shape[2] // 2
    if t:
        grid = (config.cdiv(t, FUSE_BLOCK_M), heads + kv_heads)
        _rope_kv_lora_windows_kernel[grid](
            qkv, positions, cos, sin, cache_loc, q, k_cache, v_cache, t,
            src, b, perm, slots, ranks, scalings, heads, kv_heads, half,
            qkv.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0), cos.stride(0),
            max_rank, sentinel, s_sm, s_sr, s_bs, s_bn, s_br,
            BLOCK_M=FUSE_BLOCK_M, BLOCK_HALF=max(16, config.next_pow2(half)),
            BLOCK_R=BLOCK_R, PRECISION=PRECISION, num_warps=4)
    return q


@rope_kv_lora_windows_op.register_fake
def _(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads, *args):
    return q_out(qkv, k_cache, heads)
