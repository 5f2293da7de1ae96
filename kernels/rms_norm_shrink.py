"""The residual add + RMSNorm that also computes the next projection's LoRA shrink from the
rows it normalises: ``a[row, s * max_rank + r] = out[row] @ A[slot, s * max_rank + r]^T``.

Inside a decode graph the shrink of gate_up otherwise runs beside its GEMM, which fills the
device at decode sizes: the shrink's programs then wait for SMs and its time adds to the step
(``config.NORM_SHRINK_MAX_ROWS``). Here it is part of the norm that runs anyway: a program
per (row, slice, chunk of ``CHUNK`` ranks) normalises its row (every program of the row
recomputes it from the same three L2-resident vectors; the first one stores it) and dots it
with its chunk of A. ``a`` matches ``lora_shrink``'s up to the order of the fp32 sum: the
normalised row is rounded to the model dtype first, as the GEMM and the shrink read it.

``a`` is written for every row and every column, zero past a row's rank (the neutral slot has
rank 0 in every slice, and no A row: every A load is masked by the rank).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check
from kernels.fast_launch import launch
from kernels.rms_norm_windows import norm_out, summed_row
from kernels.segments import SegmentLayout
from kernels.shrink import check_shrink_args
from kernels.traced_op import traced_op
from kernels.weights import LoRAWeights


@triton.jit
def _add_rms_norm_shrink_kernel(
    x_ptr, res_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, a_ptr, slots_ptr, la_ptr, ranks_ptr,
    cols, eps, stride_x, stride_r, stride_d, stride_o, stride_s, stride_a,
    stride_as, stride_ar, stride_ak, max_rank,
    HAS_DELTA: tl.constexpr, NUM_SLICES: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    sl = q // CHUNKS
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = summed_row(x_ptr, res_ptr, delta_ptr, row, offs, mask, stride_x, stride_r, stride_d,
                   True, HAS_DELTA)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / cols + eps)
    h = (h * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (w * h).to(out_ptr.dtype.element_ty)
    if q == 0:
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
        tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    slot = tl.load(slots_ptr + row)
    rank = tl.load(ranks_ptr + slot * NUM_SLICES + sl)
    offs_r = (q % CHUNKS) * CHUNK + tl.arange(0, CHUNK)
    r_mask = offs_r < rank
    a_rows = la_ptr + slot.to(tl.int64) * stride_as + (sl * max_rank + offs_r) * stride_ar
    lora_a = tl.load(a_rows[:, None] + offs[None, :] * stride_ak,
                     mask=r_mask[:, None] & mask[None, :], other=0.0)
    acc = tl.sum(lora_a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)
    tl.store(a_ptr + row * stride_a + sl * max_rank + offs_r, acc, mask=offs_r < max_rank)


def add_rms_norm_shrink(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, delta: torch.Tensor | None, weights: LoRAWeights,
                        layout: SegmentLayout):
    """``(norm(x + residual), x + residual, a)``, ``a`` the fp32 ``[rows, num_slices *
    max_rank]`` shrink of the normalised rows by ``weights`` for the rows of ``layout``
    (``lora_shrink``'s contract, zero past each row's rank). ``delta``: the previous
    projection's float32 LoRA delta, added to ``x`` first. The caller checked ``x``,
    ``residual`` and ``weight`` as ``rms_norm`` does."""
    out = norm_out(x, weight)
    check(out.dtype == x.dtype, lambda: f"add_rms_norm_shrink: the norm's output dtype "
          f"{out.dtype} differs from x's {x.dtype}; the shrink reads the rounded output")
    check_shrink_args(out, weights, layout, "add_rms_norm_shrink")
    return _add_rms_norm_shrink_op(x, residual, weight, eps, delta, layout.token_slots,
                                   weights.lora_a, weights.ranks, weights.max_rank,
                                   weights.num_slices)


@traced_op("multilora::add_rms_norm_shrink", mutates_args=())
def _add_rms_norm_shrink_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None, slots: torch.Tensor, lora_a: torch.Tensor,
    ranks: torch.Tensor, max_rank: int, num_slices: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, summed = norm_out(x, weight), torch.empty_like(x)
    a = x.new_empty(x.shape[0], num_slices * max_rank, dtype=torch.float32)
    if x.shape[0]:
        chunk = config.norm_shrink_chunk(x.shape[0], num_slices, max_rank)
        chunks = triton.cdiv(max_rank, chunk)
        block = config.next_pow2(x.shape[1])
        d = delta if delta is not None else x
        launch(_add_rms_norm_shrink_kernel, (x.shape[0], num_slices * chunks),
            x, residual, d, weight, out, summed, a, slots, lora_a, ranks, x.shape[1], eps,
            x.stride(0), residual.stride(0), d.stride(0), out.stride(0), summed.stride(0),
            a.stride(0), *lora_a.stride(), max_rank, HAS_DELTA=delta is not None,
            NUM_SLICES=num_slices, CHUNK=chunk, CHUNKS=chunks, BLOCK=block,
            num_warps=min(16, max(4, block // 512)))
    return out, summed, a


@_add_rms_norm_shrink_op.register_fake
def _(x, residual, weight, eps, delta, slots, lora_a, ranks, max_rank, num_slices):
    return (norm_out(x, weight), torch.empty_like(x),
            x.new_empty(x.shape[0], num_slices * max_rank, dtype=torch.float32))
