"""RoPE with the KV write and qkv's pending LoRA term, by windows of permuted rows.

A by-rows program (``kernels.rope_kv``) adds one token's term to one head: each token reads
its adapter's B columns alone, and past a few dozen rows that is the cost (256 rows at rank
64: ~200 MB of B reads a layer). A program here covers ``FUSE_BLOCK_M`` consecutive rows of the
layout's permutation (a window: rows sorted by slot, so few distinct slots) and one head: it
adds the head's term to the window's rows (one pass over the window's distinct slots, a
``tl.dot`` per slot and half head, B's head columns read once a window), rotates q and k, and
writes q, and k and v into each row's cache slot. It replaces qkv's separate expand (a
launch after the GEMM and a read-modify-write of its output) or the by-rows term where
``config.pending_by_windows`` says so.

Every row of the forward is covered (padding rows of a static view and rows of the neutral
slot: their term is zero), each by exactly one program per head: the permutation holds every
row once. Positions and cache slots are gathered per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.block_rows import clamp_rank
from kernels.fast_launch import launch
from kernels.lora_epilogue import FUSE_BLOCK_M, lora_rows
from kernels.rotary import q_out, rotate_halves
from kernels.traced_op import traced_op


@triton.jit
def _row_slice(a_ptr, rows, m_mask, slots, ranks_ptr, scal_ptr, sl, max_rank, stride_am,
               stride_ar, BLOCK_R: tl.constexpr):
    """Slice ``sl`` of each row: ``a`` with zeros past the row's rank (where the shrink left
    it undefined), the rank and the scaling (zero for the neutral slot's rank 0 and for
    padding past the window). Loaded before the slot walk, so the walk's steps wait on B's
    loads alone."""
    # Clamped as ``kernels.block_rows.load_rank`` clamps (an entry past max_rank read the
    # next slice's ``a``).
    rank = clamp_rank(tl.load(ranks_ptr + slots * 3 + sl, mask=m_mask, other=0), max_rank)
    scale = tl.load(scal_ptr + slots * 3 + sl, mask=m_mask & (rank > 0), other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    a = tl.load(a_ptr + rows[:, None] * stride_am + (sl * max_rank + offs_r)[None, :]
                * stride_ar, mask=m_mask[:, None] & (offs_r[None, :] < rank[:, None]),
                other=0.0)
    return a, rank, scale


@triton.jit
def _slice_dots(a, rank, b_ptr, stride_bs, stride_bn, stride_br, cur, mine, col, half,
                offs_d, d_mask, max_rank, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """Slot ``cur``'s unscaled ``round(a) @ B^T`` for rows ``mine`` (zero elsewhere) at the lo
    and hi halves of the head at column ``col``."""
    offs_r = tl.arange(0, BLOCK_R)
    r = tl.max(tl.where(mine, rank, 0), 0)
    b = b_ptr + cur.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    # B read up to max_rank (vectorizable; ``a`` is zero past each row's rank, B's columns
    # there finite by LoRAWeights' contract); nothing for rank 0 (the neutral slot has no B).
    b_mask = tl.where(r > 0, offs_r < max_rank, False)[:, None] & d_mask[None, :]
    b_lo = tl.load(b + (col + offs_d)[None, :] * stride_bn, mask=b_mask, other=0.0)
    b_hi = tl.load(b + (col + half + offs_d)[None, :] * stride_bn, mask=b_mask, other=0.0)
    a = tl.where(mine[:, None], a, 0.0).to(b_lo.dtype)
    return (tl.dot(a, b_lo, input_precision=PRECISION),
            tl.dot(a, b_hi, input_precision=PRECISION))


@triton.jit
def _window_terms(a0, r0, a1, r1, b_ptr, stride_bs, stride_bn, stride_br, sentinel, slots,
                  col0, col1, half, offs_d, d_mask, max_rank, BOTH: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Unscaled (lo, hi) of one slice's term at the head at ``col0`` and, with ``BOTH``, of
    another's at ``col1``: one pass over the window's distinct slots, each step's B tiles
    loaded together. A row's sum holds its own slot's dot plus exact zeros, so scaling it
    afterwards rounds as the expand's ``scaling * dot`` does."""
    lo0 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    hi0, lo1, hi1 = lo0, lo0, lo0
    b = (b_ptr, stride_bs, stride_bn, stride_br)
    cur = tl.min(slots, 0)
    while cur < sentinel:
        mine = slots == cur
        t_lo, t_hi = _slice_dots(a0, r0, *b, cur, mine, col0, half, offs_d, d_mask, max_rank,
                                 BLOCK_R, PRECISION)
        lo0 += t_lo
        hi0 += t_hi
        if BOTH:
            t_lo, t_hi = _slice_dots(a1, r1, *b, cur, mine, col1, half, offs_d, d_mask,
                                     max_rank, BLOCK_R, PRECISION)
            lo1 += t_lo
            hi1 += t_hi
        cur = tl.min(tl.where(slots > cur, slots, sentinel), 0)
    return lo0, hi0, lo1, hi1


@triton.jit
def _load_head(qkv_ptr, rows, stride_qkv, col, half, offs_d, mask):
    ptr = qkv_ptr + rows[:, None] * stride_qkv + col + offs_d[None, :]
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + half, mask=mask, other=0.0)


@triton.jit
def _add_term(lo, hi, t_lo, t_hi, scale):
    """The head's halves with the term added, rounded as the expand rounds it."""
    s = scale[:, None]
    return ((lo.to(tl.float32) + s * t_lo).to(lo.dtype),
            (hi.to(tl.float32) + s * t_hi).to(lo.dtype))


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
    head each; the others rotate a k head and copy its v head into the caches. Every load
    that does not wait on the slot walk is issued before it. Shapes and strides fixed for a
    model are compile-time (the launcher's per-argument host cost)."""
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
    per_row = (a_ptr, rows, m_mask, slots, ranks_ptr, scal_ptr)
    strides = (max_rank, stride_am, stride_ar)  # a constexpr passed in a tuple loses its kind
    walk = (b_ptr, stride_bs, stride_bn, stride_br, sentinel, slots)
    if p < heads:
        col = p * 2 * half
        lo, hi = _load_head(*head, col, half, offs_d, mask)
        a, rank, scale = _row_slice(*per_row, 0, *strides, BLOCK_R)
        t_lo, t_hi, _, _ = _window_terms(a, rank, a, rank, *walk, col, col, half, offs_d,
                                         d_mask, max_rank, False, BLOCK_M, BLOCK_HALF, BLOCK_R,
                                         PRECISION)
        lo, hi = rotate_halves(*_add_term(lo, hi, t_lo, t_hi, scale), cos, sin)
        out = q_ptr + rows[:, None] * stride_q + col + offs_d[None, :]
        tl.store(out, lo, mask=mask)
        tl.store(out + half, hi, mask=mask)
    else:
        j = p - heads
        k_col = (heads + j) * 2 * half
        v_col = k_col + kv_heads * 2 * half
        k_lo, k_hi = _load_head(*head, k_col, half, offs_d, mask)
        v_lo, v_hi = _load_head(*head, v_col, half, offs_d, mask)
        cache = tl.load(loc_ptr + rows, mask=m_mask, other=0).to(tl.int64)[:, None]
        a_k, rank_k, scale_k = _row_slice(*per_row, 1, *strides, BLOCK_R)
        a_v, rank_v, scale_v = _row_slice(*per_row, 2, *strides, BLOCK_R)
        tk_lo, tk_hi, tv_lo, tv_hi = _window_terms(a_k, rank_k, a_v, rank_v, *walk, k_col,
                                                   v_col, half, offs_d, d_mask, max_rank, True,
                                                   BLOCK_M, BLOCK_HALF, BLOCK_R, PRECISION)
        lo, hi = rotate_halves(*_add_term(k_lo, k_hi, tk_lo, tk_hi, scale_k), cos, sin)
        out = k_ptr + cache * stride_k + j * 2 * half + offs_d[None, :]
        tl.store(out, lo, mask=mask)
        tl.store(out + half, hi, mask=mask)
        lo, hi = _add_term(v_lo, v_hi, tv_lo, tv_hi, scale_v)
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
    BLOCK_K: int, wide: bool = False,
) -> torch.Tensor:
    """Rotated ``q``; k and v written to the caches. The term's arguments are
    ``kernels.row_lora.block_args``'s for a pending term (``src`` is ``a``; three slices)."""
    if SHRINK or NUM_SLICES != 3:
        raise ValueError("rope_kv_lora_windows_op takes a pending qkv term (three slices, "
                         f"SHRINK False), got NUM_SLICES={NUM_SLICES} SHRINK={SHRINK}")
    q = q_out(qkv, k_cache, heads)
    t, kv_heads, half = qkv.shape[0], k_cache.shape[1], k_cache.shape[2] // 2
    if t:
        # Wide windows (extend layouts): more bytes a program for the same chain of loads.
        window = config.ROPE_WIDE_WINDOW if wide else FUSE_BLOCK_M
        grid = (config.cdiv(t, window), heads + kv_heads)
        launch(_rope_kv_lora_windows_kernel, grid,
            qkv, positions, cos, sin, cache_loc, q, k_cache, v_cache, t,
            src, b, perm, slots, ranks, scalings, heads, kv_heads, half,
            qkv.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0), cos.stride(0),
            max_rank, sentinel, s_sm, s_sr, s_bs, s_bn, s_br,
            BLOCK_M=window, BLOCK_HALF=max(16, config.next_pow2(half)),
            BLOCK_R=BLOCK_R, PRECISION=PRECISION, num_warps=max(4, window // 4))
    return q


@rope_kv_lora_windows_op.register_fake
def _(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads, *args):
    return q_out(qkv, k_cache, heads)
