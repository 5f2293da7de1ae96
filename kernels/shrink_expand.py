"""Shrink and expand in one launch, for eager forwards of a few rows:
``y[row, cols of slice s] += scaling * (x[row] @ A[slot, s]^T) @ B[slot, cols]^T``.

The separate path costs three launches per module (the split-K shrink's memset, the shrink,
the expand), and an eager decode step is bound by their host time. Here each expand program
computes its block's ``a`` for its slice itself, over the whole K, then adds its output tiles:
the shrink is recomputed once per output group (``expand``'s grid), which costs
``groups x (BLOCK_M + BLOCK_R) x K`` reads from L2 per block, so it is only chosen for few
rows (``config.one_launch_lora``). ``a`` is rounded to the weights' dtype before the expand,
as the separate path does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_rows_disjoint, checked_override
from kernels.expand import (
    add_tiles,
    check_expand_args,
    expand_program,
    launch_shape,
    load_b_tile,
)
from kernels.fast_launch import bind, direct_launch_possible, launch
from kernels.segments import SegmentLayout
from kernels.shrink import check_shrink_args, shrink_rows
from kernels.traced_op import traced_op, tracing
from kernels.weights import LoRAWeights


@triton.jit
def _shrink_expand_kernel(
    x_ptr, la_ptr, lb_ptr, y_ptr, perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr,
    scal_ptr, slice_off_ptr,
    stride_xm, stride_xk, stride_ym, stride_yn,
    # Fixed by the weights (one compile per module shape): constants, not launch arguments,
    # each of which costs the host ~0.5 us a launch.
    K: tl.constexpr, max_rank: tl.constexpr,
    stride_as: tl.constexpr, stride_ar: tl.constexpr, stride_ak: tl.constexpr,
    stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, COL_ALIGN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    sl, n_lo, n_hi, slot, rows, m_mask, offs_r, r_mask, b_r_mask, b_base, idle = expand_program(
        perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr, slice_off_ptr,
        lb_ptr, max_rank, stride_bs, stride_bn, stride_br, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
        TILES, COL_ALIGN)
    if idle:
        return
    a = shrink_rows(x_ptr, la_ptr, rows, m_mask, slot, sl * max_rank + offs_r, r_mask, K, 0, K,
                    stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
                    BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    scale = tl.load(scal_ptr + slot * NUM_SLICES + sl)
    b = load_b_tile(b_base, b_r_mask, n_lo, n_hi, stride_bn, BLOCK_N)
    add_tiles(a.to(lb_ptr.dtype.element_ty), b, b_base, y_ptr + rows[:, None] * stride_ym, m_mask,
              b_r_mask, n_lo, n_hi, scale, stride_bn, stride_yn, BLOCK_N, TILES, PRECISION)


@traced_op("multilora::shrink_expand", mutates_args=("y",))
def _shrink_expand_op(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, slice_offsets: torch.Tensor,
    permutation: torch.Tensor, block_slots: torch.Tensor, block_starts: torch.Tensor,
    block_ends: torch.Tensor, block_m: int, num_groups: int, block_n: int, block_k: int,
    tiles: int, num_warps: int, col_align: int,
) -> None:
    grid, args, kwargs = _launch_args(
        x, lora_a, lora_b, y, ranks, scalings, slice_offsets, permutation, block_slots,
        block_starts, block_ends, block_m, num_groups, block_n, block_k, tiles, num_warps,
        col_align)
    if y.shape[0] == 0 or grid[0] == 0:
        return
    # Here, not in the launcher: a traced replay runs this body on its real tensors (a
    # tracer's fake ones have no memory to compare).
    _check_apart(x, y)
    launch(_shrink_expand_kernel, grid, *args, **kwargs)


def _launch_args(x, lora_a, lora_b, y, ranks, scalings, slice_offsets, permutation,
                 block_slots, block_starts, block_ends, block_m, num_groups, block_n, block_k,
                 tiles, num_warps, col_align) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of the kernel's launch; ``x`` and ``y`` at args 0 and 3."""
    max_rank = lora_b.shape[2]
    return (block_slots.shape[0], num_groups), (
        x, lora_a, lora_b, y, permutation, block_slots, block_starts, block_ends, ranks,
        scalings, slice_offsets, *x.stride(), *y.stride(), x.shape[1], max_rank,
        *lora_a.stride(), *lora_b.stride(), slice_offsets.shape[0] - 1, block_m, block_n,
        config.rank_block(max_rank), block_k, tiles, col_align,
        config.dot_precision(lora_b.dtype)), {"num_warps": num_warps}


def _check_apart(x: torch.Tensor, y: torch.Tensor) -> None:
    check(not shares_memory(x, y), lambda: "lora_shrink_expand: y shares memory with x; each "
          "program recomputes x's shrink while others add into y. Add in place with "
          "lora_expand(lora_shrink(x, ...), ..., y, ...), or pass a y of its own")


def lora_shrink_expand(
    x: torch.Tensor,
    weights: LoRAWeights,
    y: torch.Tensor,
    layout: SegmentLayout | None,
    block_k: int | None = None,
    tiles: int | None = None,
    block_n: int | None = None,
) -> None:
    """Adds ``x``'s LoRA term to ``y`` in place, like ``lora_expand(lora_shrink(x), y)``, in
    one launch. ``block_k``, ``tiles``, ``block_n`` override the launch heuristics (tests).
    A signature launched twice before (``_checked_tail``) goes through its ``BoundLaunch``:
    only ``x`` and ``y`` change between such calls, and an eager module's launch is
    host-bound."""
    entry = _checked_tail(x, weights, y, layout, (block_k, tiles, block_n))
    if entry.bound is not None and not tracing():
        _check_apart(x, y)
        entry.bound(x, y)
        return
    _shrink_expand_op(x, weights.lora_a, weights.lora_b, y, *entry.tail)
    # Bound at the signature's second launch: binding costs about one key, which a signature
    # met once (a batch that changes at every step) would pay for nothing.
    if entry.launched and y.shape[0] and direct_launch_possible() and not tracing():
        grid, args, kwargs = _launch_args(x, weights.lora_a, weights.lora_b, y, *entry.tail)
        if grid[0]:  # else nothing was launched, nor is there a launcher to bind
            entry.bound = bind(_shrink_expand_kernel, grid, (0, 3), *args, **kwargs)
    entry.launched = True


def shares_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether 2-D ``x`` (contiguous columns) and 2-D ``y`` of as many rows may share memory.
    Usually their byte ranges do not meet (the one that starts later starts past the other's
    end: no more is computed). Where they meet, rows of equal byte strides with contiguous
    columns (two column slices of one buffer) are compared exactly; other strided layouts
    count as sharing."""
    xp, yp = x.data_ptr(), y.data_ptr()
    if yp >= xp:
        (n, k), (sx, _) = x.shape, x.stride()
        if n == 0 or yp >= xp + ((n - 1) * sx + k) * x.element_size():
            return False
    else:
        (n, w), (s0, s1) = y.shape, y.stride()
        if n == 0 or xp >= yp + ((n - 1) * s0 + (w - 1) * s1 + 1) * y.element_size():
            return False
    return _rows_meet(x, y, yp - xp)


def _rows_meet(x: torch.Tensor, y: torch.Tensor, d: int) -> bool:
    """``shares_memory`` where the byte ranges meet; ``d``: y's first byte less x's."""
    (n, k), (sx, _) = x.shape, x.stride()
    (_, w), (s0, s1) = y.shape, y.stride()
    ex, ey = x.element_size(), y.element_size()
    s, kx, ky = sx * ex, k * ex, w * ey
    if s1 != 1:
        return True
    if n == 1:
        return -ky < d < kx
    if s0 * ey != s or s <= 0:
        return True
    # Row r of x and row r + j of y meet iff -ky < d + j * s < kx, for |j| < n.
    lo, hi = (-ky - d) // s + 1, -((d - kx) // s) - 1
    return max(lo, 1 - n) <= min(hi, n - 1)


class _OneLaunch:
    """A checked signature's launch arguments after ``x, A, B, y``, and its ``BoundLaunch``
    once it has launched twice (None before, under the interpreter, or where launches go
    through Triton)."""

    __slots__ = ("tail", "bound", "launched")

    def __init__(self, tail: tuple) -> None:
        self.tail, self.bound, self.launched = tail, None, False


def _checked_tail(x: torch.Tensor, weights: LoRAWeights, y: torch.Tensor,
                  layout: SegmentLayout | None, overrides: tuple) -> _OneLaunch:
    """The op's arguments after ``x, A, B, y`` (``.tail``), from the shrink's and the
    expand's checks in full once per signature (the weights' and the layout's tensors, ``x``'s
    and ``y``'s dtype, device, columns and strides, the overrides); after that, the rows only.
    An eager module's one launch spent more host time on its checks and heuristics than on
    the launch (it is called once a module per eager forward of few rows)."""
    w = weights
    held = (layout, w.lora_a, w.lora_b, w.ranks, w.scalings, w.slice_offsets)
    seen, sig = w.one_launch_checked, None
    if x.dim() == 2 and y.dim() == 2:  # else the checks below name the input
        # ids compare safely: ``seen`` holds the objects, so no other object takes their ids.
        # The layout (held) fixes the rows: y's strides were checked (disjoint) on as many.
        sig = (tuple(map(id, held)), x.dtype, x.device, x.shape[1], x.stride(), y.dtype,
               y.device, y.shape[1], y.stride(), overrides)
        if seen is not None and seen[1] == sig and layout.num_rows == x.shape[0] == y.shape[0]:
            return seen[2]
    check_shrink_args(x, w, layout, "lora_shrink_expand")
    check_expand_args(w, y, layout, "lora_shrink_expand")
    check_rows_disjoint("y", y)  # once per signature (the layout fixes the rows)
    block_k, tiles, block_n = overrides
    num_groups, block_n, tiles, num_warps = launch_shape(
        w.slice_widths, layout.block_m, layout.block_slots.shape[0], w.max_rank, y.device,
        tiles, block_n, None, one_launch=True)
    block_k = checked_override("block_k", block_k, least=16) or config.one_launch_k_block(
        config.rank_block(w.max_rank), layout.block_m, x.shape[1], x.element_size(),
        layout.block_slots.shape[0] * num_groups, y.device)
    tail = (w.ranks, w.scalings, w.slice_offsets, layout.permutation, layout.block_slots,
            layout.block_starts, layout.block_ends, layout.block_m, num_groups, block_n,
            block_k, tiles, num_warps, w.column_align)
    entry = _OneLaunch(tail)
    w.one_launch_checked = (held, sig, entry)
    return entry
