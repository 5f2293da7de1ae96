"""Shrink: ``a[row, s*R:(s*R+r)] = x[row] @ A[slot, s*R:(s*R+r)]^T`` for every slice s.

Grid: (block, slice, K split). Decode batches have few blocks and a long K, so K is split until
the grid covers the device; the splits then add into a zeroed fp32 output with atomics (one
memset, and the expand kernel reads ``a`` once). Without a split the output is stored directly
and never zeroed. Columns past a slot's rank and rows of the neutral slot are left unwritten
(zero, or undefined without a split): the expand kernel never reads them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.block_rows import clamp_rank, load_block, load_rank
from kernels.checks import (
    check,
    check_dtype,
    check_layout,
    check_weight_tables,
    checked_override,
    is_whole,
)
from kernels.fast_launch import launch
from kernels.segments import SegmentLayout
from kernels.traced_op import traced_op
from kernels.weights import LoRAWeights


@triton.jit
def shrink_rows(
    x_ptr, a_ptr, rows, m_mask, slot, a_rows, r_mask, K, k0, k_len,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_R]``: ``x[rows, k0:k0+k_len] @ A[slot, a_rows, k0:k0+k_len]^T``
    (zero in masked rows and columns)."""
    x_base = x_ptr + rows[:, None] * stride_xm
    a_base = a_ptr + slot.to(tl.int64) * stride_as + a_rows[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in range(0, k_len, BLOCK_K):
        offs_k = k0 + kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_base + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :],
                    other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    return acc


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr,
    K, max_rank, k_per_split,
    stride_xm, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_om, stride_or,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr, JOINT: tl.constexpr,
):
    """A program per (block, slice, K split); ``JOINT``: per (block, -, K split), its
    ``BLOCK_R`` columns spanning every slice, so x's tile is read once for all slices."""
    blk = tl.program_id(0)
    sl = tl.program_id(1)
    split = tl.program_id(2)
    slot, rows, m_mask, empty = load_block(perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr,
                                           blk, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    if JOINT:
        a_rows = offs_r
        in_cols = offs_r < NUM_SLICES * max_rank
        col_slice = tl.where(in_cols, offs_r // max_rank, 0)
        rank = clamp_rank(tl.load(ranks_ptr + slot * NUM_SLICES + col_slice), max_rank)
        r_mask = in_cols & (offs_r - col_slice * max_rank < rank)
        if (tl.max(r_mask.to(tl.int32), axis=0) == 0) | empty:
            return
    else:
        rank = load_rank(ranks_ptr + slot * NUM_SLICES + sl, max_rank)
        if (rank == 0) | empty:
            return
        r_mask = offs_r < rank
        a_rows = sl * max_rank + offs_r
    acc = shrink_rows(x_ptr, a_ptr, rows, m_mask, slot, a_rows, r_mask, K, split * k_per_split,
                      k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
                      BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    out = out_ptr + rows[:, None] * stride_om + a_rows[None, :] * stride_or
    mask = m_mask[:, None] & r_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc, mask=mask)


@traced_op("multilora::shrink", mutates_args=())
def _shrink_op(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, permutation: torch.Tensor,
    block_slots: torch.Tensor, block_starts: torch.Tensor, block_ends: torch.Tensor,
    block_m: int, num_slices: int, splits: int, k_per_split: int, block_k: int, num_warps: int,
    tail: int, joint: bool,
) -> torch.Tensor:
    """``[rows, slices * max_rank + tail]``: the shrink's columns, then ``tail`` zeros."""
    t, k = x.shape
    alloc = torch.zeros if splits > 1 or tail else torch.empty
    out = alloc(t, lora_a.shape[1] + tail, dtype=torch.float32, device=x.device)
    max_rank = lora_a.shape[1] // num_slices
    grid = (block_slots.shape[0], 1 if joint else num_slices, splits)
    if t == 0 or grid[0] == 0:
        return out
    block_r = config.rank_block(lora_a.shape[1] if joint else max_rank)
    launch(_shrink_kernel, grid,
        x, lora_a, out, permutation, block_slots, block_starts, block_ends, ranks,
        k, max_rank, k_per_split,
        *x.stride(),
        *lora_a.stride(),
        *out.stride(),
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        ATOMIC=splits > 1, PRECISION=config.dot_precision(x.dtype), JOINT=joint,
        num_warps=num_warps,
    )
    return out


@_shrink_op.register_fake
def _(x, lora_a, ranks, permutation, block_slots, block_starts, block_ends,
      block_m, num_slices, splits, k_per_split, block_k, num_warps, tail, joint):
    return x.new_empty(x.shape[0], lora_a.shape[1] + tail, dtype=torch.float32)


def lora_shrink(
    x: torch.Tensor,
    weights: LoRAWeights,
    layout: SegmentLayout | None,
    split_k: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """fp32 ``[rows, num_slices * max_rank]``, defined where the row's slot has a rank above
    the column's index within its slice. ``split_k``, ``block_k``, ``num_warps`` override the
    launch heuristics (tests, tuning)."""
    return _shrink(x, weights, layout, 0, split_k, block_k, num_warps)


def lora_shrink_with_delta(x: torch.Tensor, weights: LoRAWeights,
                           layout: SegmentLayout | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, delta)``: ``lora_shrink``'s ``a``, and a zeroed float32 ``[rows, out]`` for
    ``lora_expand`` to add the term into, both column slices of one buffer: one memset zeroes
    both (inside a graph every node on the side branch delays the join)."""
    cols = weights.num_slices * weights.max_rank
    both = _shrink(x, weights, layout, weights.lora_b.shape[1], None, None, None)
    return both[:, :cols], both[:, cols:]


def _shrink(x, weights, layout, tail, split_k, block_k, num_warps) -> torch.Tensor:
    check_shrink_args(x, weights, layout, "lora_shrink")
    joint = config.joint_shrink(x.shape[0], layout.block_m, weights.num_slices,
                                weights.max_rank, x.element_size())
    # A joint program's columns are every slice's: (slices * max_rank) wide, one slice.
    cols, slices = ((weights.num_slices * weights.max_rank, 1) if joint
                    else (weights.max_rank, weights.num_slices))
    block_k, splits, k_per_split, num_warps = _launch_shape(
        x.shape[1], cols, layout.block_slots.shape[0], slices, layout.block_m, x.device,
        split_k, block_k, num_warps, config.eager(x))
    return _shrink_op(
        x, weights.lora_a, weights.ranks, layout.permutation, layout.block_slots,
        layout.block_starts, layout.block_ends, layout.block_m, weights.num_slices, splits,
        k_per_split, block_k, num_warps, tail, joint,
    )


def check_shrink_args(x: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout | None,
                      what: str) -> None:
    # Before the layout's row count: a 1-D or 3-D x is not stale metadata.
    check(x.dim() == 2 and x.stride(1) == 1, lambda: f"x must be 2-D with contiguous rows, got "
          f"shape {tuple(x.shape)} strides {x.stride()}")
    check_layout(layout, x.shape[0], x.device, what, weights.lora_a.shape[0])
    a = weights.lora_a
    check_weight_tables(weights, weights.num_slices, x.device)
    seen = weights.shrink_checked
    if seen is not None and seen[0] is a and seen[1:] == (x.dtype, x.device, x.shape[1]):
        return
    check_dtype("x", x)
    check(not weights.is_embedding, "lora_shrink got embedding weights; use lora_embedding_shrink")
    check(a.dtype == x.dtype, lambda: f"lora_a dtype {a.dtype} differs from x dtype {x.dtype}")
    check(a.device == x.device, lambda: f"lora_a is on {a.device} but x is on {x.device}")
    check(a.dim() == 3 and a.shape[2] == x.shape[1],
          lambda: f"lora_a must be [slots, slices*max_rank, {x.shape[1]}], got {tuple(a.shape)}")
    # Not a zero-size launch: the K split divided by zero ("integer division or modulo").
    check(x.shape[1] > 0, "x has no columns (in_features 0): a LoRA term of nothing; skip "
          "the launch")
    check(a.shape[1] == weights.num_slices * weights.max_rank,
          lambda: f"lora_a has {a.shape[1]} rows; expected num_slices*max_rank = "
          f"{weights.num_slices}*{weights.max_rank}")
    weights.shrink_checked = (a, x.dtype, x.device, x.shape[1])


@functools.lru_cache(maxsize=4096)
def _launch_shape(k: int, cols: int, num_blocks: int, num_slices: int, block_m: int,
                  device: torch.device, split_k: int | None, block_k: int | None,
                  num_warps: int | None, eager: bool = False) -> tuple[int, int, int, int]:
    """(block_k, splits, k_per_split, num_warps) of one launch of ``num_slices`` programs a
    block, each of ``cols`` output columns: a function of shapes and of
    whether it runs eagerly (``config.shrink_split``), so it is computed once per shape (an
    error is raised every time: lru_cache keeps no exception)."""
    check(split_k is None or (is_whole(split_k) and split_k >= 1),
          lambda: f"split_k must be an integer >= 1 (None: the heuristic), got {split_k!r}")
    split_k = None if split_k is None else int(split_k)
    num_warps = checked_override("num_warps", num_warps)
    block_r = config.rank_block(cols)
    block_k = checked_override("block_k", block_k, least=16) or config.shrink_k_block(block_r, k)
    splits, k_per_split = config.shrink_split(k, block_k, num_blocks * num_slices, device,
                                              split_k, eager)
    return block_k, splits, k_per_split, num_warps or config.num_warps(block_m, block_r)
