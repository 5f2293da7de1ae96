"""Expand: ``y[row, cols of slice s] += scaling[slot, s] * a_s[row, :r] @ B[slot, cols, :r]^T``.

One launch covers every slice of a fused projection (qkv with unequal widths, gate_up with
equal ones). The second grid axis enumerates groups of ``TILES`` output tiles slice by slice,
so no group straddles two slices; a program loads its ``a`` tile once and walks its tiles.

Inside a captured graph on Hopper the expand is launched as a programmatic dependent of the
base GEMM before it (``config.use_pdl``): its programs may start while the GEMM drains and
read what the host wrote before the replay (segment tables, ranks, scalings); they read ``a``
and ``y``, which earlier kernels write, only after ``gdc_wait`` (hazard: any read of a
kernel-written tensor must stay below it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.block_rows import load_block, load_rank
from kernels.checks import (
    check,
    check_dtype,
    check_layout,
    check_rows_disjoint,
    check_weight_tables,
    checked_override,
)
from kernels.fast_launch import launch
from kernels.segments import SegmentLayout
from kernels.traced_op import traced_op
from kernels.weights import LoRAWeights


@triton.jit
def slice_group(slice_off_ptr, group, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
                TILES: tl.constexpr, COL_ALIGN: tl.constexpr):
    """(slice, first column, the slice's end column) of output group ``group``: groups
    enumerate ``TILES`` tiles at a time, slice by slice, so none straddles two slices.
    ``COL_ALIGN`` divides every slice bound (``LoRAWeights.column_align``); told to the
    compiler, it turns the column-masked accesses of ``y`` into 16-byte vector accesses
    (scalar 2-byte ones without it: the prefill expand ran at 1.5-1.7 TB/s)."""
    sl = 0
    n_lo = 0
    n_hi = 0
    before = 0
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(slice_off_ptr + s)
        hi = tl.load(slice_off_ptr + s + 1)
        ng = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), TILES)
        here = (group >= before) & (group < before + ng)
        sl = tl.where(here, s, sl)
        n_lo = tl.where(here, lo + (group - before) * (TILES * BLOCK_N), n_lo)
        n_hi = tl.where(here, hi, n_hi)
        before += ng
    # Hazard: a COL_ALIGN that does not divide the bounds masks columns in groups of it.
    return sl, tl.multiple_of(n_lo, COL_ALIGN), tl.multiple_of(n_hi, COL_ALIGN)


@triton.jit
def expand_program(perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr, slice_off_ptr,
                   b_ptr, max_rank, stride_bs, stride_bn, stride_br,
                   NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, TILES: tl.constexpr, COL_ALIGN: tl.constexpr):
    """What an expand program (grid: blocks x output groups) knows before reading any input
    that a kernel writes: its slice and columns, block, rows, the slot's rank mask (for ``a``),
    B's (``b_r_mask``), where B's rows start, and whether it has nothing to do (rank-0 slot,
    empty block, no columns)."""
    sl, n_lo, n_hi = slice_group(slice_off_ptr, tl.program_id(1), NUM_SLICES, BLOCK_N, TILES,
                                 COL_ALIGN)
    slot, rows, m_mask, empty = load_block(perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr,
                                           tl.program_id(0), BLOCK_M)
    rank = load_rank(ranks_ptr + slot * NUM_SLICES + sl, max_rank)
    idle = (rank == 0) | empty | (n_lo >= n_hi)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # Hazard: B is read up to max_rank, not the slot's rank (a mask the compiler can vectorize:
    # max_rank is specialized as a multiple of 16); ``a`` is zero past the rank, so B's columns
    # there only need to be finite (LoRAWeights' contract: zeros).
    b_r_mask = offs_r < max_rank
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    return sl, n_lo, n_hi, slot, rows, m_mask, offs_r, r_mask, b_r_mask, b_base, idle


@triton.jit
def load_b_tile(b_base, b_r_mask, n0, n_hi, stride_bn, BLOCK_N: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(b_base + offs_n[None, :] * stride_bn,
                   mask=b_r_mask[:, None] & (offs_n < n_hi)[None, :], other=0.0)


@triton.jit
def add_tiles(a, b, b_base, y_rows, m_mask, b_r_mask, n_lo, n_hi, scale, stride_bn, stride_yn,
              BLOCK_N: tl.constexpr, TILES: tl.constexpr, PRECISION: tl.constexpr):
    """``y[rows, tile] += scale * a @ B_tile`` for the group's tiles; ``b`` is the first tile,
    already loaded (the PDL prologue loads it before the wait). A loop, not unrolled: two
    unrolled 64 x 128 tiles took 254 registers a thread."""
    for t in tl.range(0, TILES, num_stages=1):  # TILES <= 8 (config.expand_tiles_per_program)
        offs_n = n_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        if t > 0:
            b = load_b_tile(b_base, b_r_mask, n_lo + t * BLOCK_N, n_hi, stride_bn, BLOCK_N)
        y_ptrs = y_rows + offs_n[None, :] * stride_yn
        y_mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        acc = tl.dot(a, b, input_precision=PRECISION)
        tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(y.dtype), mask=y_mask)


@triton.jit
def _expand_kernel(
    a_ptr, b_ptr, y_ptr, perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr,
    scal_ptr, slice_off_ptr,
    max_rank,
    stride_am, stride_ar,
    stride_bs, stride_bn, stride_br,
    stride_ym, stride_yn,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, TILES: tl.constexpr, COL_ALIGN: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    sl, n_lo, n_hi, slot, rows, m_mask, offs_r, r_mask, b_r_mask, b_base, idle = expand_program(
        perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr, slice_off_ptr,
        b_ptr, max_rank, stride_bs, stride_bn, stride_br, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
        TILES, COL_ALIGN)
    if idle:
        return
    # B was written before the replay began: its first tile loads before the wait.
    b = load_b_tile(b_base, b_r_mask, n_lo, n_hi, stride_bn, BLOCK_N)
    scale = tl.load(scal_ptr + slot * NUM_SLICES + sl)
    if PDL:  # every read below this line may depend on the kernels before this one
        tl.extra.cuda.gdc_wait()
    a = tl.load(a_ptr + rows[:, None] * stride_am + (sl * max_rank + offs_r)[None, :] * stride_ar,
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    add_tiles(a.to(b_ptr.dtype.element_ty), b, b_base, y_ptr + rows[:, None] * stride_ym, m_mask,
              b_r_mask, n_lo, n_hi, scale, stride_bn, stride_yn, BLOCK_N, TILES, PRECISION)


@traced_op("multilora::expand", mutates_args=("y",))
def _expand_op(
    a: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, ranks: torch.Tensor,
    scalings: torch.Tensor, slice_offsets: torch.Tensor, permutation: torch.Tensor,
    block_slots: torch.Tensor, block_starts: torch.Tensor, block_ends: torch.Tensor,
    block_m: int, num_groups: int, block_n: int, tiles: int, num_warps: int, col_align: int,
) -> None:
    num_slices = slice_offsets.shape[0] - 1
    max_rank = lora_b.shape[2]
    grid = (block_slots.shape[0], num_groups)
    if y.shape[0] == 0 or grid[0] == 0:
        return
    pdl = {"launch_pdl": True} if config.use_pdl(y.device) else {}
    launch(_expand_kernel, grid,
        a, lora_b, y, permutation, block_slots, block_starts, block_ends, ranks,
        scalings, slice_offsets,
        max_rank,
        *a.stride(),
        *lora_b.stride(),
        *y.stride(),
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=config.rank_block(max_rank), TILES=tiles, COL_ALIGN=col_align,
        PRECISION=config.dot_precision(lora_b.dtype), PDL=bool(pdl),
        num_warps=num_warps, **pdl,
    )


def lora_expand(
    a: torch.Tensor,
    weights: LoRAWeights,
    y: torch.Tensor,
    layout: SegmentLayout | None,
    tiles: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Adds the LoRA term to ``y`` in place. ``a`` is ``lora_shrink``'s output (or the
    embedding gather's). ``tiles``, ``block_n``, ``num_warps`` override the launch heuristics
    (tests, tuning)."""
    check_expand_args(weights, y, layout, "lora_expand")
    s = y.stride()  # per call (it depends on the rows); the usual y in two comparisons
    if not (s[1] == 1 and (s[0] >= y.shape[1] or y.shape[0] <= 1)):
        check_rows_disjoint("y", y)
    check_shrunk(a, weights, y)
    num_groups, block_n, tiles, num_warps = launch_shape(
        weights.slice_widths, layout.block_m, layout.block_slots.shape[0], weights.max_rank,
        y.device, tiles, block_n, num_warps)
    _expand_op(
        a, weights.lora_b, y, weights.ranks, weights.scalings, weights.slice_offsets,
        layout.permutation, layout.block_slots, layout.block_starts, layout.block_ends,
        layout.block_m, num_groups, block_n, tiles, num_warps, weights.column_align,
    )


def check_shrunk(a: torch.Tensor, weights: LoRAWeights, y: torch.Tensor) -> None:
    """``a`` is what ``lora_shrink`` returns for ``y``'s rows of these weights, on ``y``'s
    device."""
    want = (y.shape[0], weights.num_slices * weights.max_rank)
    check(tuple(a.shape) == want and a.dtype == torch.float32,
          lambda: f"a must be float32 {list(want)} from lora_shrink, got {a.dtype} {list(a.shape)}")
    if a.device != y.device:
        raise ValueError(f"a is on {a.device} but y is on {y.device}: pass lora_shrink's "
                         "output for inputs on y's device")


def check_expand_args(weights: LoRAWeights, y: torch.Tensor, layout: SegmentLayout | None,
                      what: str) -> None:
    b = weights.lora_b

    def bad_shape() -> str:
        return f"y must be [rows, {b.shape[1]}] (the module's output), got {tuple(y.shape)}"

    # Before the layout's row count: a 1-D or 3-D y is not stale metadata.
    check(y.dim() == 2, bad_shape)
    check_layout(layout, y.shape[0], y.device, what, weights.lora_a.shape[0])
    check(y.shape[1] == b.shape[1], bad_shape)
    check_weight_tables(weights, weights.num_slices, y.device)
    seen = weights.expand_checked
    if seen is not None and seen[0] is b and seen[1:] == (y.dtype, y.device):
        return
    check_dtype("y", y)
    check_dtype("lora_b", b)  # a float32 y takes B of another dtype
    check(b.dtype == y.dtype or y.dtype == torch.float32,
          lambda: f"lora_b dtype {b.dtype} differs from y dtype {y.dtype} (y may also be a "
          "float32 delta)")
    check(b.device == y.device, lambda: f"lora_b is on {b.device} but y is on {y.device}")
    check(b.dim() == 3 and b.shape[0] == weights.num_slots and b.shape[2] == weights.max_rank,
          lambda: f"lora_b must be [slots={weights.num_slots}, out, "
          f"max_rank={weights.max_rank}], got {tuple(b.shape)}")
    weights.expand_checked = (b, y.dtype, y.device)


@functools.lru_cache(maxsize=4096)
def launch_shape(slice_widths: tuple[int, ...], block_m: int, num_blocks: int, max_rank: int,
                 device: torch.device, tiles: int | None, block_n: int | None,
                 num_warps: int | None, one_launch: bool = False) -> tuple[int, int, int, int]:
    """(groups, block_n, tiles, num_warps) of one launch (``one_launch``: of the shrink and
    expand in one kernel): a function of shapes only, so it is computed once per shape (its
    Python cost per eager launch was ~8 us on a slow host). An override that is no power of
    two is refused (every time: lru_cache keeps no exception); tiles past the kernel's cap
    run at the cap."""
    tiles = checked_override("tiles", tiles)
    block_n = checked_override("block_n", block_n)
    num_warps = checked_override("num_warps", num_warps)
    block_r = config.rank_block(max_rank)
    block_n = block_n or config.expand_n_block(max(slice_widths), block_m, block_r, one_launch)
    slice_tiles = tuple(config.cdiv(w, block_n) for w in slice_widths)
    tiles = config.expand_tiles_per_program(num_blocks, slice_tiles, block_m, block_r,
                                            device, tiles, one_launch)
    num_groups = sum(config.cdiv(n, tiles) for n in slice_tiles)
    return num_groups, block_n, tiles, num_warps or config.expand_warps(block_m, block_n,
                                                                          block_r, one_launch)
