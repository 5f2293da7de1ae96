"""A projection's LoRA term added row by row inside the kernel that consumes its output
(RoPE with the KV write, SwiGLU's activation, the residual add + RMSNorm).

A by-rows consumer program handles one row (or one head of it): it reads the row's slot from
the layout's ``token_slots`` and adds ``scaling * round(a) @ B[slot, cols]^T`` to its columns
(``row_lora_term``: a sum over the rank, no ``tl.dot``), rounded to the output's dtype as
``lora_expand`` rounds it. ``a`` comes from one of two places (``row_lora_a``):

- loaded (``kernels.lora_epilogue.PendingLoRA``): the shrink ran before, beside the GEMM;
- computed by the program itself (``UnshrunkLoRA``, ``SHRINK``): the row's ``x @ A^T`` over
  the whole K. An eager forward of a few rows is bound by host time (~70 us a launch on the
  H200 host), and this leaves LoRA no launch of its own: the consumer runs anyway. Every
  program recomputes its row's shrink (RoPE: once per group of heads, SwiGLU: once per
  column group), so it is chosen for few rows only (``config.shrink_in_consumer``). The
  shrink is one program's serial loop of dependent loads: its steps are wide
  (``config.ROW_SHRINK_ELEMENTS``) and it takes the rank ``RANK_CHUNK`` at a time, so a
  low-rank row of a high-rank pool loads only its own chunks.

Hazard: a row of the neutral slot has rank 0, and the neutral slot has no A or B row: every
A load is masked by the rank (the shrink computes no chunk for rank 0), every B load by the
slot (``live``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.block_rows import load_rank
from kernels.expand import check_expand_args
from kernels.segments import SegmentLayout
from kernels.shrink import check_shrink_args
from kernels.shrink_expand import lora_shrink_expand
from kernels.weights import LoRAWeights


def row_args(src: torch.Tensor, weights: LoRAWeights, shrink: bool) -> tuple:
    """What a by-rows consumer's op takes after its own arguments but the layout's
    ``token_slots`` (``row_lora_a`` order, then NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
    NEUTRAL; the B strides after A's): ``src`` is ``a`` (``shrink`` False) or the
    projection's input."""
    c = _constants(weights)
    k = src.shape[1] if shrink else 0
    return (src, *c[:5], k, src.stride(0), src.stride(1), *c[5:], shrink,
            config.row_shrink_k_block(c[-1], max(k, 1)), weights.neutral_slot)


def block_args(src: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout,
               shrink: bool) -> tuple:
    """What a by-blocks consumer's op takes after its own arguments (``kernels.lora_epilogue``:
    ``src``, B, the layout's permutation and ``token_slots``, ranks, scalings, max_rank, the
    sentinel slot, ``src``'s and B's strides, then A, K and A's strides, NUM_SLICES, BLOCK_R,
    PRECISION, SHRINK, BLOCK_K): ``src`` is ``a`` (``shrink`` False; A unused) or the
    projection's input, whose rows the program shrinks a block at a time. All but ``src`` and
    its strides are kept with the weights for the last layout and signature (an eager step
    reuses both)."""
    sig = (shrink, src.shape[1], src.dtype)
    c = weights.block_constants
    if c is None or c[0] is not layout or c[1] != sig or c[2] is not _constants(weights):
        w, b = weights, weights.lora_b
        block_r = config.rank_block(w.max_rank)
        la, k = (w.lora_a, src.shape[1]) if shrink else (src, 0)
        a_strides = la.stride() if shrink else (0, 0, 0)
        head = (b, layout.permutation, layout.token_slots, w.ranks, w.scalings, w.max_rank,
                w.neutral_slot + 1)
        tail = (*b.stride(), w.lora_a if shrink else None, k, *a_strides, w.num_slices,
                block_r, config.dot_precision(b.dtype), shrink,
                config.block_shrink_k_block(block_r, k) if shrink else 16)
        c = weights.block_constants = (layout, sig, _constants(weights), head, tail)
    *_, head, tail = c
    if not shrink:  # A is unused: the kernel takes ``a`` in its place
        tail = (*tail[:3], src, *tail[4:])
    return (src, *head, *src.stride(), *tail)


def _constants(w: LoRAWeights) -> tuple:
    """A, B, ranks, scalings, max_rank, A's and B's strides, NUM_SLICES, BLOCK_R: built once
    per weights (fixed buffers that the slot pool writes in place)."""
    c = w.row_constants
    if c is None or not (c[0] is w.lora_a and c[1] is w.lora_b and c[2] is w.ranks
                         and c[3] is w.scalings):
        a, b = w.lora_a, w.lora_b
        c = w.row_constants = (a, b, w.ranks, w.scalings, w.max_rank, *a.stride(), *b.stride(),
                               w.num_slices, config.rank_block(w.max_rank))
    return c


class UnshrunkLoRA:
    """A projection's whole LoRA term left to the consumer of its output: its input ``x``
    (``[rows, in]``, contiguous rows) for the rows of ``layout``. A by-rows consumer computes
    the shrink and the expand itself (``row_args``); ``apply`` adds the term in place with
    the one-launch kernel. Built once a module per eager forward: kept lean."""

    __slots__ = ("x", "weights", "layout", "_tail")

    def __init__(self, x: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout) -> None:
        self.x, self.weights, self.layout = x, weights, layout
        self._tail: tuple | None = None  # ``row_args`` after ``x``, set by ``check``

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        lora_shrink_expand(self.x, self.weights, y, self.layout)
        return y

    def check(self, y: torch.Tensor, what: str) -> None:
        """The expand's and the shrink's checks in full once per signature of the weights,
        ``x`` and ``y`` (a consumer's eager checks cost host time at every step); after that
        the rows and the layout's device only. The launch arguments that follow from the
        signature are kept with it."""
        x, w, layout = self.x, self.weights, self.layout
        c = _constants(w)
        sig = (x.dtype, y.dtype, y.device, x.shape[1:], y.shape[1:], x.stride(), y.stride(-1),
               x.device)
        seen = w.unshrunk_checked
        if (seen is not None and seen[0] is c and seen[1] == sig and layout is not None
                and layout.num_rows == x.shape[0] == y.shape[0]
                and layout.checked_on == sig[2] and (layout.max_slot or 0) <= seen[3]):
            self._tail = seen[2]
            return
        check_expand_args(w, y, layout, what)
        check_shrink_args(x, w, layout, what)
        self._tail = row_args(x, w, shrink=True)[1:]
        w.unshrunk_checked = (c, sig, self._tail, w.neutral_slot)

    def block_args(self) -> tuple:
        return block_args(self.x, self.weights, self.layout, shrink=True)

    def row_args(self) -> tuple:
        tail = self._tail if self._tail is not None else row_args(self.x, self.weights,
                                                                  shrink=True)[1:]
        return (self.layout.token_slots, self.x, *tail)


# ``row_lora_a``'s default, not a global the kernels read: Triton compares every global a
# kernel reads with its compile-time value at each launch (~3 us a launch on the H200 host).
_RANK_CHUNK = tl.constexpr(config.ROW_RANK_CHUNK)


@triton.jit
def row_lora_a(slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr, max_rank, K,
               stride_s0, stride_s1, stride_as, stride_ar, stride_ak, row, sl,
               NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, SHRINK: tl.constexpr,
               BLOCK_K: tl.constexpr, NEUTRAL: tl.constexpr,
               RANK_CHUNK: tl.constexpr = _RANK_CHUNK):
    """``(a, slot, live, scaling)`` of row ``row``'s slice ``sl``: ``a`` fp32 ``[BLOCK_R]``,
    rounded to B's dtype as the expand rounds it, zero past the slot's rank; loaded from
    ``src`` (``a``), or with ``SHRINK`` computed from ``src`` (``x``) and A over the whole K.
    ``live``: the slot has B rows (not the neutral slot ``NEUTRAL``).

    A decode consumer waits on this chain of loads: the slot, then its rank, scaling and B
    (``row_lora_term``), so none of them may wait on the rank too; a pending ``a`` loads
    beside the slot (its address is the row's) and is zeroed past the rank afterwards."""
    slot = tl.load(slots_ptr + row)
    rank = load_rank(ranks_ptr + slot * NUM_SLICES + sl, max_rank)
    # 0 for rank 0, as the expand skips the slot: a NaN scaling there added NaN (NaN * 0).
    # Every slot, the neutral one too, has a scaling entry.
    scale = tl.where(rank > 0, tl.load(scal_ptr + slot * NUM_SLICES + sl), 0.0)
    offs_r = tl.arange(0, BLOCK_R)
    if SHRINK:
        x_row = src_ptr + row * stride_s0
        a_slot = la_ptr + slot.to(tl.int64) * stride_as + sl * max_rank * stride_ar
        if BLOCK_R > RANK_CHUNK:
            a = _shrink_by_rank_chunks(x_row, a_slot, rank, K, stride_s1, stride_ar, stride_ak,
                                       BLOCK_R, RANK_CHUNK, BLOCK_K)
        else:
            a = _shrink_by_rank_chunks(x_row, a_slot, rank, K, stride_s1, stride_ar, stride_ak,
                                       BLOCK_R, BLOCK_R, BLOCK_K)
    else:
        a = tl.load(src_ptr + row * stride_s0 + (sl * max_rank + offs_r) * stride_s1,
                    mask=offs_r < max_rank, other=0.0)
        # a select, not a product: the shrink leaves columns past the rank unwritten
        a = tl.where(offs_r < rank, a, 0.0)
    return a.to(b_ptr.dtype.element_ty).to(tl.float32), slot, slot < NEUTRAL, scale


@triton.jit
def _shrink_by_rank_chunks(x_row, a_slot, rank, K, stride_x, stride_ar, stride_ak,
                           BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``[BLOCK_R]``: ``x_row @ A^T`` over the whole K for the first ``rank`` rows of A
    (``a_slot``), ``CHUNK`` ranks at a time; chunks past ``rank`` are skipped."""
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c in tl.static_range(BLOCK_R // CHUNK):
        if c * CHUNK < rank:
            offs_c = c * CHUNK + tl.arange(0, CHUNK)
            c_mask = offs_c < rank
            part = tl.zeros((CHUNK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                x = tl.load(x_row + offs_k * stride_x, mask=k_mask, other=0.0)
                w = tl.load(a_slot + offs_c[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                            mask=c_mask[:, None] & k_mask[None, :], other=0.0)
                part += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            acc += tl.sum(tl.where(offs_r[:, None] == offs_c[None, :], part[None, :], 0.0),
                          axis=1)
    return acc


@triton.jit
def row_lora_term(a, b_ptr, slot, live, scale, offs_n, n_mask, stride_bs, stride_bn, stride_br,
                  max_rank, BLOCK_R: tl.constexpr):
    """fp32 ``[BLOCK_N]``: ``scale * a @ B[slot, offs_n]^T`` (zero for rank 0); ``live``:
    the slot has B rows (``row_lora_a``)."""
    offs_r = tl.arange(0, BLOCK_R)
    # B read up to max_rank (a mask the compiler vectorizes; ``a`` is zero past the rank, B's
    # columns there finite by LoRAWeights' contract, a rank-0 slot's too); nothing for the
    # neutral slot, which has no B.
    r_mask = tl.where(live, offs_r < max_rank, False)  # not `&`: the interpreter rejects it
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn
                + offs_r[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    return scale * tl.sum(b.to(tl.float32) * a[None, :], axis=1)
