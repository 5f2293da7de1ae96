"""Expand: ``y[row, cols of slice s] += scaling[slot, s] * a_s[row, :r] @ B[slot, cols, :r]^T``.

One launch covers every slice of a fused projection (qkv with unequal widths, gate_up with
equal ones): the second grid axis enumerates output tiles slice by slice, so no tile straddles
two slices. ``a`` arrives as the shrink kernel's split-K partials and is summed on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype, check_layout, check_tables
from kernels.segments import SegmentLayout
from kernels.weights import LoRAWeights


@triton.jit
def _expand_kernel(
    p_ptr, b_ptr, y_ptr, perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr,
    scal_ptr, slice_off_ptr,
    num_splits, max_rank,
    stride_ps, stride_pm, stride_pr,
    stride_bs, stride_bn, stride_br,
    stride_ym, stride_yn,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    blk = tl.program_id(0)
    tile = tl.program_id(1)
    # Which slice owns this tile: walk the (few) slices, counting their tiles.
    sl = 0
    n_lo = 0
    n_hi = 0
    tiles_before = 0
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(slice_off_ptr + s)
        hi = tl.load(slice_off_ptr + s + 1)
        nt = tl.cdiv(hi - lo, BLOCK_N)
        here = (tile >= tiles_before) & (tile < tiles_before + nt)
        sl = tl.where(here, s, sl)
        n_lo = tl.where(here, lo + (tile - tiles_before) * BLOCK_N, n_lo)
        n_hi = tl.where(here, hi, n_hi)
        tiles_before += nt
    slot = tl.load(blk_slot_ptr + blk)
    start = tl.load(blk_start_ptr + blk)
    end = tl.load(blk_end_ptr + blk)
    rank = tl.load(ranks_ptr + slot * NUM_SLICES + sl)
    if (rank == 0) | (start >= end) | (n_lo >= n_hi):
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    p_cols = sl * max_rank + offs_r
    p_base = p_ptr + rows[:, None] * stride_pm + p_cols[None, :] * stride_pr
    a = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(num_splits):
        a += tl.load(p_base + s * stride_ps, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
        + offs_r[:, None] * stride_br,
        mask=r_mask[:, None] & n_mask[None, :], other=0.0,
    )
    acc = tl.dot(a.to(b.dtype), b, input_precision=PRECISION)
    scale = tl.load(scal_ptr + slot * NUM_SLICES + sl)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(y.dtype), mask=y_mask)


@torch.library.custom_op("multilora::expand", mutates_args=("y",))
def _expand_op(
    partials: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, ranks: torch.Tensor,
    scalings: torch.Tensor, slice_offsets: torch.Tensor, permutation: torch.Tensor,
    block_slots: torch.Tensor, block_starts: torch.Tensor, block_ends: torch.Tensor,
    block_m: int, num_tiles: int, block_n: int,
) -> None:
    num_slices = slice_offsets.shape[0] - 1
    max_rank = lora_b.shape[2]
    grid = (block_slots.shape[0], num_tiles)
    if y.shape[0] == 0 or grid[0] == 0:
        return
    _expand_kernel[grid](
        partials, lora_b, y, permutation, block_slots, block_starts, block_ends, ranks,
        scalings, slice_offsets,
        partials.shape[0], max_rank,
        partials.stride(0), partials.stride(1), partials.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        NUM_SLICES=num_slices,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=config.rank_block(max_rank),
        PRECISION=config.dot_precision(lora_b.dtype),
    )


def lora_expand(
    partials: torch.Tensor, weights: LoRAWeights, y: torch.Tensor, layout: SegmentLayout | None
) -> None:
    """Adds the LoRA term to ``y`` in place. ``partials`` is ``lora_shrink``'s output (or the
    embedding gather's)."""
    check_layout(layout, y.shape[0] if y.dim() == 2 else -1, y.device, "lora_expand")
    b = weights.lora_b
    check(y.dim() == 2 and y.shape[1] == b.shape[1],
          f"y must be [rows, {b.shape[1]}] (the module's output), got {tuple(y.shape)}")
    check_dtype("y", y)
    check(b.dtype == y.dtype, f"lora_b dtype {b.dtype} differs from y dtype {y.dtype}")
    check(b.device == y.device, f"lora_b is on {b.device} but y is on {y.device}")
    check(b.shape[2] == weights.max_rank,
          f"lora_b must be [slots, out, max_rank={weights.max_rank}], got {tuple(b.shape)}")
    want = (y.shape[0], weights.num_slices * weights.max_rank)
    check(partials.dim() == 3 and tuple(partials.shape[1:]) == want
          and partials.dtype == torch.float32,
          f"partials must be float32 [splits, {want[0]}, {want[1]}] from lora_shrink, got "
          f"{partials.dtype} {tuple(partials.shape)}")
    check_tables(weights.ranks, weights.scalings, weights.num_slots, weights.num_slices, y.device)
    block_n = config.expand_n_block(max(weights.slice_widths))
    num_tiles = sum(-(-w // block_n) for w in weights.slice_widths)
    _expand_op(
        partials, b, y, weights.ranks, weights.scalings, weights.slice_offsets,
        layout.permutation, layout.block_slots, layout.block_starts, layout.block_ends,
        layout.block_m, num_tiles, block_n,
    )
