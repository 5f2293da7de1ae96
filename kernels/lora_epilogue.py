"""The expand folded into the kernel that consumes a projection's output.

The kernel that reads a projection's output next can add the LoRA term to the rows it loads:
``y[row, cols of slice s] + scaling[slot, s] * a_s[row, :r] @ B[slot, cols, :r]^T``, rounded to
``y``'s dtype exactly as ``lora_expand`` rounds it, before its own arithmetic. That saves the
expand's read-modify-write of ``y`` and its launch, which at decode sizes is the expand's whole
cost: it sits on the critical path after the base GEMM (``config.ROW_EPILOGUE_MAX_ROWS``).
SwiGLU's activation does it for gate_up (``kernels.silu_mul``), RoPE with the KV write for qkv
(``kernels.rope_kv``).

Two program shapes:

- by rows (``kernels.row_lora``, forwards of at most ``config.ROW_EPILOGUE_MAX_ROWS`` rows):
  a program handles one row, reads its slot from the layout's ``token_slots`` and that slot's
  B columns, and sums ``a * B`` over the rank (no ``tl.dot``: one row). No slot loop, so
  decode rows of many adapters cost what rows of one do.
- by blocks (``lora_delta``, gate_up from ``config.FUSED_EXPAND_MIN_ROWS`` rows): a program
  covers ``BLOCK_M`` consecutive rows of the layout's permutation (a window), so its rows are
  sorted by slot and hold few distinct slots; it loads B once per distinct slot (``while``
  over the slots present) and masks the other rows' ``a`` to zero. An eager unshrunk term
  (``UnshrunkLoRA.block_args``, ``config.unshrunk_by_windows``) has the program compute its
  window's ``a`` too (``block_shrink``: a ``tl.dot`` loop over K per distinct slot), then
  serve a group of column tiles with it. SwiGLU has both; the residual add + RMSNorm has the
  by-windows shape in ``kernels.rms_norm_windows`` (eager only), RoPE with the KV write in
  ``kernels.rope_kv_windows`` (a pending term, in graphs too).

Every row is covered, those of the neutral slot and padding rows included (the consumer's own
work), unlike the LoRA kernels' grids, which skip them.

Hazard: ``a`` is undefined in rows of the neutral slot and past a slot's rank (the shrink
leaves them unwritten); it is read under a rank mask or selected with ``tl.where``, never
multiplied by a zero mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.block_rows import load_rank
from kernels.checks import check
from kernels.expand import check_expand_args, check_shrunk, lora_expand
from kernels.row_lora import block_args, row_args
from kernels.segments import SegmentLayout
from kernels.shrink import shrink_rows
from kernels.weights import LoRAWeights

FUSE_BLOCK_M = 16
"""Permuted rows per consumer program (``tl.dot`` needs at least 16)."""


@dataclass(frozen=True)
class PendingLoRA:
    """A projection's LoRA term, shrunk but not yet added: ``a`` (``lora_shrink``'s output)
    for the rows of ``layout``. A consumer kernel adds it (``block_args``), or ``apply`` runs
    the expand in place."""

    a: torch.Tensor
    weights: LoRAWeights
    layout: SegmentLayout

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        lora_expand(self.a, self.weights, y, self.layout)
        return y

    def check(self, y: torch.Tensor, what: str) -> None:
        check_expand_args(self.weights, y, self.layout, what)
        check_shrunk(self.a, self.weights, y)

    def block_args(self) -> tuple:
        """What a by-blocks consumer's op takes after its own arguments (``block_args``)."""
        return block_args(self.a, self.weights, self.layout, shrink=False)

    def row_args(self) -> tuple:
        """What a by-rows consumer's op takes after its own arguments (``kernels.row_lora``)."""
        return (self.layout.token_slots, *row_args(self.a, self.weights, shrink=False))


@dataclass(frozen=True)
class LoRADelta:
    """A projection's LoRA term already expanded beside its GEMM
    (``LoRABackend.linear_delta``): float32 ``[rows, out]``, zero in rows without an adapter.
    A consumer kernel adds it elementwise to what it loads (``HAS_DELTA``), rounded as the
    expand rounds it; ``apply`` returns ``y`` with it added."""

    delta: torch.Tensor

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return (y.float() + self.delta).to(y.dtype)

    def check(self, y: torch.Tensor, what: str) -> None:
        d = self.delta
        # An empty delta's strides are arbitrary (``0.3 * torch.randn(0, 1)`` has (1, 0)).
        check(d.dtype == torch.float32 and d.shape == y.shape
              and (d.stride(-1) == 1 or d.numel() == 0) and d.device == y.device,
              lambda: f"{what}: the LoRA delta must be float32 {tuple(y.shape)} with "
              f"contiguous rows on {y.device} (LoRABackend.linear_delta), got {d.dtype} "
              f"{tuple(d.shape)} on {d.device}")


@triton.jit
def lora_rows(perm_ptr, slots_ptr, first, n_rows, sentinel, BLOCK_M: tl.constexpr):
    """(rows, row mask, slots) of permuted rows ``first .. first + BLOCK_M``; rows past
    ``n_rows`` get slot ``sentinel`` (above every real and the neutral slot)."""
    offs = first + tl.arange(0, BLOCK_M)
    m_mask = offs < n_rows
    rows = tl.load(perm_ptr + offs, mask=m_mask, other=0).to(tl.int64)
    slots = tl.load(slots_ptr + rows, mask=m_mask, other=sentinel)
    return rows, m_mask, slots


@triton.jit
def block_a(a_ptr, rows, m_mask, sl, max_rank, stride_am, stride_ar, BLOCK_R: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_R]``: a pending term's ``a`` of slice ``sl`` for ``rows``
    (undefined where the shrink left it so: ``lora_delta`` selects, never multiplies)."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(a_ptr + rows[:, None] * stride_am + (sl * max_rank + offs_r)[None, :]
                   * stride_ar, mask=m_mask[:, None] & (offs_r < max_rank)[None, :], other=0.0)


@triton.jit
def block_shrink(x_ptr, la_ptr, ranks_ptr, max_rank, sentinel, K, stride_xm, stride_xk,
                 stride_as, stride_ar, stride_ak, rows, m_mask, slots, sl,
                 NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_R]``: each row's ``x[row] @ A[its slot, slice sl]^T`` over the
    whole K, one ``tl.dot`` loop per distinct slot of the block (an unshrunk term by blocks:
    A is read once a block, not once a row); zero past a slot's rank and for rank 0."""
    offs_r = tl.arange(0, BLOCK_R)
    a = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    cur = tl.min(slots, 0)
    while cur < sentinel:
        rank = load_rank(ranks_ptr + cur * NUM_SLICES + sl, max_rank)
        if rank > 0:
            a += shrink_rows(x_ptr, la_ptr, rows, m_mask & (slots == cur), cur,
                             sl * max_rank + offs_r, offs_r < rank, K, 0, K, stride_xm,
                             stride_xk, stride_as, stride_ar, stride_ak, BLOCK_M, BLOCK_R,
                             BLOCK_K, PRECISION)
        cur = tl.min(tl.where(slots > cur, slots, sentinel), 0)
    return a


@triton.jit
def _slot_dot(a, b_ptr, scale, rank, mine, offs_n, b_mask, offs_r, stride_bn, stride_br,
              PRECISION: tl.constexpr):
    """Slot-local ``scale * round(a) @ B^T`` for rows ``mine`` (zero elsewhere and for rank 0:
    selected, so a rank-0 slice's NaN scaling or B never reaches the sum)."""
    b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn, mask=b_mask,
                other=0.0)
    a = tl.where(mine[:, None] & (offs_r < rank)[None, :], a, 0.0).to(b.dtype)
    return tl.where(rank > 0, scale * tl.dot(a, b, input_precision=PRECISION), 0.0)


@triton.jit
def lora_delta(y0, y1, a0, a1, b_ptr, ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn,
               stride_br, slots, offs_n0, offs_n1, n_mask, sl0, max_rank, BOTH: tl.constexpr,
               NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_N]`` pair: ``y0`` (the consumer's loaded tile, in fp32) plus slice
    ``sl0``'s LoRA term at B rows ``offs_n0`` of rows whose ``a0`` is given (``block_a`` or
    ``block_shrink``; zero for rows without one) and, with ``BOTH``, ``y1`` plus slice ``sl0 +
    1``'s at ``offs_n1`` from ``a1`` (else ``y1``). Each row gets its slot's ``scaling * dot``
    and exact zeros, so rounding the sum to ``y``'s dtype rounds as the expand does. The tiles
    accumulate in place: no separate term tiles, whose registers cost the kernel occupancy.

    One walk over the block's distinct slots serves both slices, and a step's loads (both
    slices' ranks, scalings and B tiles) go out side by side: a step waits one load, not a
    rank and then the B it gates. B is read for every slot but the neutral one (``sentinel -
    1``, which has no B row) up to ``max_rank`` (a mask the compiler vectorizes), ``a`` zeroed
    past the rank: B's columns there need only be finite (LoRAWeights' contract)."""
    offs_r = tl.arange(0, BLOCK_R)
    cur = tl.min(slots, 0)
    while cur < sentinel:
        b = b_ptr + cur.to(tl.int64) * stride_bs
        b_mask = tl.where(cur < sentinel - 1, offs_r < max_rank, False)[:, None] & n_mask[None, :]
        mine = slots == cur
        tab = cur * NUM_SLICES + sl0
        rank0 = load_rank(ranks_ptr + tab, max_rank)
        scale0 = tl.load(scal_ptr + tab)
        y0 += _slot_dot(a0, b, scale0, rank0, mine, offs_n0, b_mask, offs_r, stride_bn,
                        stride_br, PRECISION)
        if BOTH:
            rank1 = load_rank(ranks_ptr + tab + 1, max_rank)
            scale1 = tl.load(scal_ptr + tab + 1)
            y1 += _slot_dot(a1, b, scale1, rank1, mine, offs_n1, b_mask, offs_r, stride_bn,
                            stride_br, PRECISION)
        cur = tl.min(tl.where(slots > cur, slots, sentinel), 0)
    return y0, y1
