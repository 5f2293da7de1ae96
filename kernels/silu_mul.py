"""SwiGLU's ``silu(gate) * up`` over the gate_up projection's output in one launch (torch
takes two and a round trip of the activation through memory).

Rounds like torch: ``silu(gate)`` to the model dtype, then the product."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype
from kernels.traced_op import traced_op

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [rows, 2 * inter]`` (gate first, then up) -> ``[rows, inter]``."""
    check_dtype("gate_up", gate_up)
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1,
          lambda: f"gate_up must be [rows, 2 * intermediate] with contiguous rows, got shape "
          f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    return _silu_mul_op(gate_up)


def _out(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@traced_op("multilora::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    out = _out(gate_up)
    inter = out.shape[1]
    if gate_up.shape[0]:
        block = min(BLOCK, config.next_pow2(inter))
        _silu_mul_kernel[(gate_up.shape[0], config.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


@_silu_mul_op.register_fake
def _(gate_up):
    return _out(gate_up)
