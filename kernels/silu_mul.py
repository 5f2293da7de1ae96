"""SwiGLU's ``silu(gate) * up`` over the gate_up projection's output in one launch (torch
takes two and a round trip of the activation through memory).

Rounds like torch: ``silu(gate)`` to the model dtype, then the product."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype
from kernels.fast_launch import launch
from kernels.lora_epilogue import (
    FUSE_BLOCK_M,
    LoRADelta,
    PendingLoRA,
    block_a,
    block_shrink,
    lora_delta,
    lora_rows,
)
from kernels.row_lora import UnshrunkLoRA, row_lora_a, row_lora_term
from kernels.traced_op import traced_op

BLOCK = 1024
LORA_BLOCK_N = 128


@triton.jit
def _silu_mul_kernel(x_ptr, d_ptr, out_ptr, inter, stride_x, stride_d, stride_o,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # gate_up's LoRA term, computed beside its GEMM (LoRADelta)
        d = d_ptr + row * stride_d + offs
        gate = (gate.to(tl.float32) + tl.load(d, mask=mask, other=0.0)).to(gate.dtype)
        up = (up.to(tl.float32) + tl.load(d + inter, mask=mask, other=0.0)).to(gate.dtype)
    up = up.to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_lora_kernel(
    x_ptr, out_ptr, n_rows, src_ptr, b_ptr, perm_ptr, slots_ptr, ranks_ptr, scal_ptr, la_ptr,
    inter: tl.constexpr, stride_x: tl.constexpr, stride_o: tl.constexpr,
    max_rank: tl.constexpr, sentinel: tl.constexpr, stride_sm: tl.constexpr,
    stride_sr: tl.constexpr, stride_bs: tl.constexpr, stride_bn: tl.constexpr,
    stride_br: tl.constexpr, K: tl.constexpr, stride_as: tl.constexpr,
    stride_ar: tl.constexpr, stride_ak: tl.constexpr, NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_K: tl.constexpr, TILES: tl.constexpr,
):
    """Grid (blocks of ``BLOCK_M`` permuted rows, column groups): a program's ``a`` (both
    slices; loaded, or with ``SHRINK`` computed from the projection's input ``src``) serves
    ``TILES`` tiles of ``BLOCK_N`` columns. Shapes and strides fixed for a model are
    compile-time (the launcher's per-argument host cost)."""
    rows, m_mask, slots = lora_rows(perm_ptr, slots_ptr, tl.program_id(0) * BLOCK_M, n_rows,
                                    sentinel, BLOCK_M)
    if SHRINK:
        shrink = (src_ptr, la_ptr, ranks_ptr, max_rank, sentinel, K, stride_sm, stride_sr,
                  stride_as, stride_ar, stride_ak, rows, m_mask, slots)
        a_g = block_shrink(*shrink, 0, NUM_SLICES, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
        a_u = block_shrink(*shrink, 1, NUM_SLICES, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    else:
        a_g = block_a(src_ptr, rows, m_mask, 0, max_rank, stride_sm, stride_sr, BLOCK_R)
        a_u = block_a(src_ptr, rows, m_mask, 1, max_rank, stride_sm, stride_sr, BLOCK_R)
    lora = (b_ptr, ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn, stride_br, slots)
    for i in range(TILES):
        offs = (tl.program_id(1) * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs < inter
        mask = m_mask[:, None] & n_mask[None, :]
        ptrs = x_ptr + rows[:, None] * stride_x + offs[None, :]
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + inter, mask=mask, other=0.0)
        g, u = lora_delta(gate.to(tl.float32), up.to(tl.float32), a_g, a_u, *lora, offs,
                          inter + offs, n_mask, 0, max_rank, True, NUM_SLICES, BLOCK_R,
                          PRECISION)
        gate, up = g.to(gate.dtype), u.to(gate.dtype)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :],
                 (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_lora_rows_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o,
    slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr,
    max_rank: tl.constexpr, K: tl.constexpr, stride_s0: tl.constexpr, stride_s1: tl.constexpr,
    stride_as: tl.constexpr, stride_ar: tl.constexpr, stride_ak: tl.constexpr,
    stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_K: tl.constexpr, NEUTRAL: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    """Grid (rows, column groups): a program's ``a`` (both slices) serves ``TILES`` tiles of
    ``BLOCK_N`` columns."""
    row = tl.program_id(0).to(tl.int64)
    lora = (slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr, max_rank, K, stride_s0,
            stride_s1, stride_as, stride_ar, stride_ak, row)
    a_g, slot, live, scale_g = row_lora_a(*lora, 0, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
                                          NEUTRAL)
    a_u, _, _, scale_u = row_lora_a(*lora, 1, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
                                    NEUTRAL)
    for i in range(TILES):
        offs = (tl.program_id(1) * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs < inter
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
        gate = (gate.to(tl.float32) + row_lora_term(
            a_g, b_ptr, slot, live, scale_g, offs, mask, stride_bs, stride_bn, stride_br,
            max_rank, BLOCK_R)).to(gate.dtype)
        up = (up.to(tl.float32) + row_lora_term(
            a_u, b_ptr, slot, live, scale_u, inter + offs, mask, stride_bs, stride_bn,
            stride_br, max_rank, BLOCK_R)).to(gate.dtype)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        out = (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def silu_mul(gate_up: torch.Tensor,
             lora: PendingLoRA | UnshrunkLoRA | LoRADelta | None = None) -> torch.Tensor:
    """``gate_up [rows, 2 * inter]`` (gate first, then up) -> ``[rows, inter]``. ``lora``: the
    gate_up projection's LoRA term (two slices: gate, up), pending, unshrunk or as a delta,
    added first."""
    check_dtype("gate_up", gate_up)
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1,
          lambda: f"gate_up must be [rows, 2 * intermediate] with contiguous rows, got shape "
          f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    if lora is None:
        return _silu_mul_op(gate_up)
    if isinstance(lora, LoRADelta):
        lora.check(gate_up, "silu_mul")
        return _silu_mul_op(gate_up, lora.delta)
    lora.check(gate_up, "silu_mul")
    w = lora.weights
    check(w.slice_widths == (gate_up.shape[1] // 2,) * 2,
          lambda: f"silu_mul: the LoRA term's slices {w.slice_widths} are not gate and up of "
          f"{gate_up.shape[1] // 2} columns each")
    rows = gate_up.shape[0]
    if isinstance(lora, UnshrunkLoRA):
        if config.unshrunk_by_windows(rows, w.max_rank, "silu_mul",
                                      lora.layout.block_slots.shape[0]):
            return _silu_mul_lora_op(gate_up, *lora.block_args())
        return _silu_mul_lora_rows_op(gate_up, *lora.row_args())
    if config.row_epilogue(rows, "silu_mul", w.num_slots):
        return _silu_mul_lora_rows_op(gate_up, *lora.row_args())
    return _silu_mul_lora_op(gate_up, *lora.block_args(),
                             config.wide_blocks(rows, lora.layout.block_m))


def _out(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@traced_op("multilora::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    out = _out(gate_up)
    inter = out.shape[1]
    if gate_up.shape[0]:
        block = min(BLOCK, config.next_pow2(inter))
        d = delta if delta is not None else gate_up
        launch(_silu_mul_kernel, (gate_up.shape[0], config.cdiv(inter, block)),
            gate_up, d, out, inter, gate_up.stride(0), d.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=4)
    return out


@_silu_mul_op.register_fake
def _(gate_up, delta=None):
    return _out(gate_up)


@traced_op("multilora::silu_mul_lora", mutates_args=())
def _silu_mul_lora_op(
    gate_up: torch.Tensor, src: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
    slots: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int,
    sentinel: int, s_sm: int, s_sr: int, s_bs: int, s_bn: int, s_br: int, la: torch.Tensor,
    K: int, s_as: int, s_ar: int, s_ak: int, NUM_SLICES: int, BLOCK_R: int, PRECISION: str,
    SHRINK: bool, BLOCK_K: int, wide: bool = False,
) -> torch.Tensor:
    out = _out(gate_up)
    rows, inter = out.shape
    if rows:
        # An unshrunk term's windows are the layout's FUSE_BLOCK_M rows (its shrink's shape).
        wide = wide and not SHRINK
        block_m, block_n, warps = config.WIDE_BLOCK if wide else (FUSE_BLOCK_M, LORA_BLOCK_N, 4)
        block_n = min(block_n, config.next_pow2(inter))
        blocks, tiles = config.cdiv(rows, block_m), config.cdiv(inter, block_n)
        # A program that computes its block's shrink serves more columns with it.
        per_program = config.cdiv(tiles, config.block_shrink_groups(blocks, tiles)) if (
            SHRINK) else max(1, min(config.PENDING_SILU_TILES, tiles))
        launch(_silu_mul_lora_kernel, (blocks, config.cdiv(tiles, per_program)),
            gate_up, out, rows, src, b, perm, slots, ranks, scalings, la, inter,
            gate_up.stride(0), out.stride(0), max_rank, sentinel, s_sm, s_sr, s_bs, s_bn,
            s_br, K, s_as, s_ar, s_ak, NUM_SLICES=NUM_SLICES, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_R=BLOCK_R, PRECISION=PRECISION, SHRINK=SHRINK,
            BLOCK_K=BLOCK_K, TILES=per_program,
            num_warps=config.num_warps(FUSE_BLOCK_M, BLOCK_K) if SHRINK else warps,
            **(config.wide_options() if wide else {}))
    return out


@_silu_mul_lora_op.register_fake
def _(gate_up, *args):
    return _out(gate_up)


@traced_op("multilora::silu_mul_lora_rows", mutates_args=())
def _silu_mul_lora_rows_op(
    gate_up: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, la: torch.Tensor,
    b: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, K: int,
    s_s0: int, s_s1: int, s_as: int, s_ar: int, s_ak: int, s_bs: int, s_bn: int, s_br: int,
    NUM_SLICES: int, BLOCK_R: int, SHRINK: bool, BLOCK_K: int, NEUTRAL: int,
) -> torch.Tensor:
    out = _out(gate_up)
    rows, inter = out.shape
    if rows:
        block_n = min(config.row_block_n(BLOCK_R), config.next_pow2(inter))
        tiles = config.cdiv(inter, block_n)
        # A program that computes its row's shrink serves more columns with it.
        per_program = config.cdiv(tiles, config.silu_shrink_groups(rows)) if SHRINK else 1
        launch(_silu_mul_lora_rows_kernel, (rows, config.cdiv(tiles, per_program)),
            gate_up, out, inter, gate_up.stride(0), out.stride(0),
            slots, src, la, b, ranks, scalings, max_rank, K, s_s0, s_s1, s_as, s_ar, s_ak,
            s_bs, s_bn, s_br, NUM_SLICES=NUM_SLICES, BLOCK_R=BLOCK_R, SHRINK=SHRINK,
            BLOCK_K=BLOCK_K, NEUTRAL=NEUTRAL, BLOCK_N=block_n, TILES=per_program,
            num_warps=config.row_shrink_warps() if SHRINK else 4)
    return out


@_silu_mul_lora_rows_op.register_fake
def _(gate_up, *args):
    return _out(gate_up)
