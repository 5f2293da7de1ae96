"""RMSNorm, optionally fused with the residual add before it: one launch per norm where the
torch version takes about eight (cast, square, mean, rsqrt, scale, cast back, weight).

Numerics follow Hugging Face's Llama step by step, each intermediate rounded to the model
dtype where torch rounds it: ``s = x + residual`` (rounded), ``h = s * rsqrt(mean(s^2) + eps)``
in fp32, rounded, then ``weight * h`` rounded. So the kernel and the torch reference agree to
the last bit or so, and greedy tokens do not depend on the backend.

With the pending LoRA term of the projection before it (o_proj, down_proj; decode-sized
forwards, ``kernels.lora_epilogue``) the add-and-norm program of a row first adds the term to
``x`` chunk by chunk, storing the sum as it goes, then normalises what it stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype
from kernels.lora_epilogue import PendingLoRA, lora_row_delta
from kernels.traced_op import traced_op


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, cols, eps,
                     stride_x, stride_r, stride_o, stride_s,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
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
def _add_rms_norm_lora_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, cols, eps,
                              stride_x, stride_r, stride_o, stride_s,
                              a_ptr, b_ptr, slots_ptr, ranks_ptr, scal_ptr, max_rank,
                              stride_am, stride_ar, stride_bs, stride_bn, stride_br,
                              NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr,
                              CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lora = (a_ptr, b_ptr, slots_ptr, ranks_ptr, scal_ptr, max_rank, stride_am, stride_ar,
            stride_bs, stride_bn, stride_br, row)
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32)
             + lora_row_delta(*lora, offs, mask, 0, NUM_SLICES, BLOCK_R)).to(x.dtype)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
        h = x.to(tl.float32)
        acc += h * h
    inv = tl.rsqrt(tl.sum(acc, 0) / cols + eps)
    tl.debug_barrier()  # the sums stored above are read back below
    for c in tl.static_range(NUM_CHUNKS):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < cols
        x = tl.load(sum_ptr + row * stride_s + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * h).to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, lora: PendingLoRA | None = None):
    """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``.

    ``x``, ``residual``: ``[rows, hidden]`` (rows contiguous in their last dimension).
    ``lora``: the pending LoRA term of the projection that produced ``x`` (one slice), added
    to ``x`` first; only with ``residual``."""
    check_dtype("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, lambda: f"x must be 2-D with contiguous rows, got "
          f"shape {tuple(x.shape)} strides {x.stride()}; pass x.contiguous()")
    check(weight.shape == (x.shape[1],), lambda: f"weight has shape {tuple(weight.shape)}, "
          f"expected ({x.shape[1]},) (the hidden size of x)")
    if residual is None:
        check(lora is None, "rms_norm: a pending LoRA term is added with the residual; pass "
              "residual, or apply the term (PendingLoRA.apply) first")
        return _rms_norm_op(x, weight, eps)
    check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1,
          lambda: f"residual must match x ({tuple(x.shape)}, {x.dtype}, contiguous rows), got "
          f"{tuple(residual.shape)}, {residual.dtype}")
    if lora is None:
        return _add_rms_norm_op(x, residual, weight, eps)
    lora.check(x, "rms_norm")
    check(lora.weights.num_slices == 1,
          lambda: f"rms_norm: the LoRA term has {lora.weights.num_slices} slices; a norm "
          "takes the term of a single-slice projection (o_proj, down_proj)")
    if not config.row_epilogue(x.shape[0], "norm"):  # the separate expand, into a copy
        return _add_rms_norm_op(lora.apply(x.clone()), residual, weight, eps)
    return _add_rms_norm_lora_op(x, residual, weight, eps, *lora.row_args())


def _launch(x, residual, weight, eps, out, summed) -> None:
    if x.shape[0] == 0:
        return
    block = config.next_pow2(x.shape[1])
    res, s = (residual, summed) if residual is not None else (x, out)
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, s, x.shape[1], eps, x.stride(0), res.stride(0), out.stride(0),
        s.stride(0), HAS_RES=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)))


def _out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


@traced_op("multilora::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = _out(x, weight)
    _launch(x, None, weight, eps, out, None)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return _out(x, weight)


@traced_op("multilora::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _out(x, weight), torch.empty_like(x)
    _launch(x, residual, weight, eps, out, summed)
    return out, summed


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return _out(x, weight), torch.empty_like(x)


@traced_op("multilora::add_rms_norm_lora", mutates_args=())
def _add_rms_norm_lora_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                          ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, s_am: int,
                          s_ar: int, s_bs: int, s_bn: int, s_br: int, NUM_SLICES: int,
                          BLOCK_R: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _out(x, weight), torch.empty_like(x)
    rows, cols = x.shape
    if rows:
        chunk = min(config.norm_chunk(BLOCK_R), config.next_pow2(cols))
        _add_rms_norm_lora_kernel[(rows,)](
            x, residual, weight, out, summed, cols, eps, x.stride(0), residual.stride(0),
            out.stride(0), summed.stride(0), a, b, slots, ranks, scalings, max_rank, s_am, s_ar,
            s_bs, s_bn, s_br, NUM_SLICES=NUM_SLICES, BLOCK_R=BLOCK_R, CHUNK=chunk,
            NUM_CHUNKS=config.cdiv(cols, chunk), num_warps=8)
    return out, summed


@_add_rms_norm_lora_op.register_fake
def _(x, residual, weight, eps, *args):
    return _out(x, weight), torch.empty_like(x)
