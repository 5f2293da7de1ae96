"""RMSNorm, optionally fused with the residual add before it: one launch per norm where the
torch version takes about eight (cast, square, mean, rsqrt, scale, cast back, weight).

Numerics follow Hugging Face's Llama step by step, each intermediate rounded to the model
dtype where torch rounds it: ``s = x + residual`` (rounded), ``h = s * rsqrt(mean(s^2) + eps)``
in fp32, rounded, then ``weight * h`` rounded. So the kernel and the torch reference agree to
the last bit or so, and greedy tokens do not depend on the backend.

``lora`` (optional): the previous projection's LoRA term, added to ``x`` first and rounded as
the expand would round it, ``x = round(x + term)``: a float32 delta computed beside its GEMM
(``LoRADelta``), or a by-rows term (``kernels.row_lora``: pending, or unshrunk for eager
forwards of few rows), which a program per row adds column chunk by column chunk before it
normalises the summed row it stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype
from kernels.fast_launch import launch
from kernels.lora_epilogue import LoRADelta, PendingLoRA
from kernels.rms_norm_split import add_rms_norm_lora_split
from kernels.rms_norm_windows import add_rms_norm_lora_windows_op, norm_out
from kernels.row_lora import UnshrunkLoRA, row_lora_a, row_lora_term
from kernels.traced_op import traced_op


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, cols, eps,
                     stride_x, stride_r, stride_d, stride_o, stride_s,
                     HAS_RES: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d).to(x.dtype)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / cols + eps)
    h = (h * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_lora_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, cols, eps, stride_x, stride_r, stride_o,
    stride_s, slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr,
    max_rank: tl.constexpr, K: tl.constexpr, stride_s0: tl.constexpr, stride_s1: tl.constexpr,
    stride_as: tl.constexpr, stride_ar: tl.constexpr, stride_ak: tl.constexpr,
    stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_K: tl.constexpr, NEUTRAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a, slot, live, scale = row_lora_a(
        slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr, max_rank, K, stride_s0,
        stride_s1, stride_as, stride_ar, stride_ak, row, 0, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
        NEUTRAL)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + row_lora_term(a, b_ptr, slot, live, scale, offs, mask,
                                              stride_bs, stride_bn, stride_br, max_rank,
                                              BLOCK_R)
             ).to(x.dtype)
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
        h = x.to(tl.float32)
        sq += h * h
    inv = tl.rsqrt(tl.sum(sq, 0) / cols + eps)
    tl.debug_barrier()  # the summed row this program stored, read back by every thread
    for c0 in range(0, cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(sum_ptr + row * stride_s + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * h).to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             lora: LoRADelta | PendingLoRA | UnshrunkLoRA | None = None):
    """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``; ``lora``,
    the LoRA term of the projection that produced ``x``, is added to ``x`` first.

    ``x``, ``residual``: ``[rows, hidden]`` (rows contiguous in their last dimension)."""
    check_dtype("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, lambda: f"x must be 2-D with contiguous rows, got "
          f"shape {tuple(x.shape)} strides {x.stride()}; pass x.contiguous()")
    check(weight.shape == (x.shape[1],), lambda: f"weight has shape {tuple(weight.shape)}, "
          f"expected ({x.shape[1]},) (the hidden size of x)")
    check(weight.is_floating_point() and (weight.numel() <= 1 or weight.stride(0) == 1)
          and weight.device == x.device,
          lambda: f"weight must be a contiguous floating-point vector on {x.device} (x's "
          f"device), got {weight.dtype} with stride {weight.stride()} on {weight.device}")
    if lora is not None:
        lora.check(x, "rms_norm")
    delta = lora.delta if isinstance(lora, LoRADelta) else None
    if residual is None:
        if lora is not None and delta is None:  # by rows only with a residual to store into
            return _rms_norm_op(lora.apply(x.clone()), weight, eps)
        return _rms_norm_op(x, weight, eps, delta)
    check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
          and residual.device == x.device,
          lambda: f"residual must match x ({tuple(x.shape)}, {x.dtype}, contiguous rows, on "
          f"{x.device}), got {tuple(residual.shape)}, {residual.dtype} on {residual.device}")
    if lora is None or delta is not None:
        return _add_rms_norm_op(x, residual, weight, eps, delta)
    check(lora.weights.num_slices == 1,
          lambda: f"rms_norm: a by-rows LoRA term must have one slice (o_proj, down_proj), "
          f"got {lora.weights.num_slices}")
    if _by_windows(x, lora):
        return add_rms_norm_lora_windows_op(x, residual, weight, eps, *lora.block_args())
    split = isinstance(lora, PendingLoRA) and config.norm_rows_split(x)
    return _add_rms_norm_lora_op(x, residual, weight, eps, split, *lora.row_args())


def _by_windows(x: torch.Tensor, lora: PendingLoRA | UnshrunkLoRA) -> bool:
    if isinstance(lora, UnshrunkLoRA):
        return config.unshrunk_by_windows(x.shape[0], lora.weights.max_rank, "norm",
                                          lora.layout.block_slots.shape[0])
    return config.pending_by_windows(x, "norm")


def _launch(x, residual, delta, weight, eps, out, summed) -> None:
    if x.shape[0] == 0:
        return
    block = config.next_pow2(x.shape[1])
    res, s = (residual, summed) if residual is not None else (x, out)
    d = delta if delta is not None else x
    launch(_rms_norm_kernel, (x.shape[0],),
        x, res, d, weight, out, s, x.shape[1], eps, x.stride(0), res.stride(0), d.stride(0),
        out.stride(0), s.stride(0), HAS_RES=residual is not None, HAS_DELTA=delta is not None,
        BLOCK=block, num_warps=min(16, max(1, block // 512)))


@traced_op("multilora::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    out = norm_out(x, weight)
    _launch(x, None, delta, weight, eps, out, None)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps, delta=None):
    return norm_out(x, weight)


@traced_op("multilora::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, delta: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = norm_out(x, weight), torch.empty_like(x)
    _launch(x, residual, delta, weight, eps, out, summed)
    return out, summed


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, delta=None):
    return norm_out(x, weight), torch.empty_like(x)


@traced_op("multilora::add_rms_norm_lora", mutates_args=())
def _add_rms_norm_lora_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, split: bool,
    slots: torch.Tensor, src: torch.Tensor, la: torch.Tensor, b: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, K: int, s_s0: int, s_s1: int,
    s_as: int, s_ar: int, s_ak: int, s_bs: int, s_bn: int, s_br: int, NUM_SLICES: int,
    BLOCK_R: int, SHRINK: bool, BLOCK_K: int, NEUTRAL: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``split``: each row split over column groups (``kernels.rms_norm_split``)."""
    out, summed = norm_out(x, weight), torch.empty_like(x)
    if split:
        add_rms_norm_lora_split(x, residual, weight, eps, out, summed, (
            slots, src, la, b, ranks, scalings, max_rank, K, s_s0, s_s1, s_as, s_ar, s_ak,
            s_bs, s_bn, s_br, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K, NEUTRAL))
    elif x.shape[0]:
        # With SHRINK the program's whole term is serial: wider column steps, more warps.
        per_step = config.ROW_SHRINK_ELEMENTS // BLOCK_R if SHRINK else config.row_block_n(
            BLOCK_R)
        block = min(max(per_step, 32), config.next_pow2(x.shape[1]))
        launch(_add_rms_norm_lora_kernel, (x.shape[0],),
            x, residual, weight, out, summed, x.shape[1], eps, x.stride(0), residual.stride(0),
            out.stride(0), summed.stride(0), slots, src, la, b, ranks, scalings, max_rank, K,
            s_s0, s_s1, s_as, s_ar, s_ak, s_bs, s_bn, s_br, NUM_SLICES=NUM_SLICES,
            BLOCK_R=BLOCK_R, SHRINK=SHRINK, BLOCK_K=BLOCK_K, NEUTRAL=NEUTRAL, BLOCK=block,
            num_warps=config.row_shrink_warps() if SHRINK else 4)
    return out, summed


@_add_rms_norm_lora_op.register_fake
def _(x, residual, weight, eps, *args):
    return norm_out(x, weight), torch.empty_like(x)
