"""The residual add + RMSNorm with o_proj's or down's LoRA term, by windows of permuted rows.

A by-rows program (``kernels.rms_norm``) walks its row's B columns alone: at 256 rows and
rank 64 that is 256 programs each reading 512 KB of B in sequence (~85 us on the H200). Here
a program covers ``FUSE_BLOCK_M`` consecutive rows of the layout's permutation (a window:
rows sorted by slot, so few distinct slots) and a group of column tiles: it adds the term
(``lora_delta``: one ``tl.dot`` per distinct slot, B read once a window), then the residual,
stores the summed rows and the group's partial sums of squares. The norm needs whole rows:
the last program of a window to finish (an atomic counter per window) reads the partial sums
back, and normalises the window's summed rows. One launch: the counters and partial sums
live in the device's scratch (``kernels.norm_scratch``, whose hazards apply), which the kernel
leaves as it found it, so no memset precedes it (an eager step is bound by its launches' host
time).

Hazards: the last program reads what the window's other programs stored. Each program's
stores are ordered before its counter increment by a barrier and the increment's release;
the last one's acquire orders its reads after them, and it reads through L2 (``.cg``), never
a stale L1 line. Partial sums are stored per group and summed in group order, not added
atomically: the norm of a row does not depend on the programs' finishing order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.fast_launch import launch
from kernels.lora_epilogue import FUSE_BLOCK_M, block_a, block_shrink, lora_delta, lora_rows
from kernels.norm_scratch import norm_scratch
from kernels.traced_op import traced_op

BLOCK_N = 128
"""Columns of a tile of the first pass (B's tile: rank block x BLOCK_N)."""
TAIL_N = 256
"""Columns the last program normalises a step."""


@triton.jit
def _add_rms_norm_lora_windows_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, part_ptr, count_ptr, n_rows,
    src_ptr, b_ptr, perm_ptr, slots_ptr, ranks_ptr, scal_ptr, la_ptr,
    cols: tl.constexpr, eps: tl.constexpr, stride_x: tl.constexpr, stride_r: tl.constexpr,
    stride_o: tl.constexpr, stride_s: tl.constexpr, max_rank: tl.constexpr,
    sentinel: tl.constexpr, stride_sm: tl.constexpr, stride_sr: tl.constexpr,
    stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
    K: tl.constexpr, stride_as: tl.constexpr, stride_ar: tl.constexpr, stride_ak: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, SHRINK: tl.constexpr, BLOCK_K: tl.constexpr,
    TILES: tl.constexpr, GROUPS: tl.constexpr, TAIL_N: tl.constexpr,
):
    """Grid (windows, column groups of ``TILES`` tiles). ``part``: fp32 ``[GROUPS, n_rows]``;
    ``count``: int32 ``[windows]``, zero at launch and left zero. Shapes, strides and
    constants fixed for a model are compile-time: Triton's launcher inspects every runtime
    argument at each launch (~1 us each on the H200 host, and an eager step is host-bound)."""
    win = tl.program_id(0)
    group = tl.program_id(1)
    rows, m_mask, slots = lora_rows(perm_ptr, slots_ptr, win * BLOCK_M, n_rows, sentinel,
                                    BLOCK_M)
    if SHRINK:
        a = block_shrink(src_ptr, la_ptr, ranks_ptr, max_rank, sentinel, K, stride_sm,
                         stride_sr, stride_as, stride_ar, stride_ak, rows, m_mask, slots, 0,
                         1, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    else:
        a = block_a(src_ptr, rows, m_mask, 0, max_rank, stride_sm, stride_sr, BLOCK_R)
    lora = (b_ptr, ranks_ptr, scal_ptr, sentinel, stride_bs, stride_bn, stride_br, slots)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in range(TILES):
        offs = (group * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs < cols
        mask = m_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        xf, _ = lora_delta(xf, xf, a, a, *lora, offs, offs, n_mask, 0, max_rank, False, 1,
                           BLOCK_R, PRECISION)
        x = xf.to(x.dtype)
        r = tl.load(res_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None] * stride_s + offs[None, :], x, mask=mask)
        h = x.to(tl.float32)
        sq += tl.sum(h * h, axis=1)
    tl.store(part_ptr + group * n_rows + rows, sq, mask=m_mask)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    done = tl.atomic_add(count_ptr + win, 1, sem="acq_rel")
    if done == GROUPS - 1:
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for g in range(GROUPS):
            total += tl.load(part_ptr + g * n_rows + rows, mask=m_mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(count_ptr + win, 0)  # left as found: the next launch's counters
        inv = tl.rsqrt(total / cols + eps)
        for c0 in range(0, cols, TAIL_N):
            offs = c0 + tl.arange(0, TAIL_N)
            n_mask = offs < cols
            mask = m_mask[:, None] & n_mask[None, :]
            s = tl.load(sum_ptr + rows[:, None] * stride_s + offs[None, :], mask=mask,
                        other=0.0, cache_modifier=".cg")
            h = (s.to(tl.float32) * inv[:, None]).to(s.dtype).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :],
                     (w[None, :] * h).to(out_ptr.dtype.element_ty), mask=mask)


def norm_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A norm's output: ``x``'s shape, the promoted dtype of ``x`` and the norm weight."""
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


@traced_op("multilora::add_rms_norm_lora_windows", mutates_args=())
def add_rms_norm_lora_windows_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    src: torch.Tensor, b: torch.Tensor, perm: torch.Tensor, slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, max_rank: int, sentinel: int, s_sm: int,
    s_sr: int, s_bs: int, s_bn: int, s_br: int, la: torch.Tensor, K: int, s_as: int,
    s_ar: int, s_ak: int, NUM_SLICES: int, BLOCK_R: int, PRECISION: str, SHRINK: bool,
    BLOCK_K: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + term + residual), x + term + residual)``; the term's arguments are
    ``kernels.row_lora.block_args``'s (one slice)."""
    out, summed = norm_out(x, weight), torch.empty_like(x)
    rows, cols = x.shape
    if rows:
        block_n = min(BLOCK_N, max(16, config.next_pow2(cols)))
        windows, tiles = config.cdiv(rows, FUSE_BLOCK_M), config.cdiv(cols, block_n)
        groups = config.block_shrink_groups(windows, tiles) if SHRINK else tiles
        per_program = config.cdiv(tiles, groups)
        groups = config.cdiv(tiles, per_program)
        count, part = norm_scratch(x.device, windows, groups * rows)
        launch(_add_rms_norm_lora_windows_kernel, (windows, groups),
            x, residual, weight, out, summed, part, count, rows,
            src, b, perm, slots, ranks, scalings, la, cols, eps,
            x.stride(0), residual.stride(0), out.stride(0), summed.stride(0),
            max_rank, sentinel, s_sm, s_sr, s_bs, s_bn, s_br, K, s_as, s_ar, s_ak,
            BLOCK_M=FUSE_BLOCK_M, BLOCK_N=block_n,
            BLOCK_R=BLOCK_R, PRECISION=PRECISION, SHRINK=SHRINK, BLOCK_K=BLOCK_K,
            TILES=per_program, GROUPS=groups, TAIL_N=min(TAIL_N, config.next_pow2(cols)),
            num_warps=config.num_warps(FUSE_BLOCK_M, BLOCK_K) if SHRINK else 4)
    return out, summed


@add_rms_norm_lora_windows_op.register_fake
def _(x, residual, weight, eps, *args):
    return norm_out(x, weight), torch.empty_like(x)
