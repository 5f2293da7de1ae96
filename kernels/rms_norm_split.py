"""The residual add + RMSNorm with o_proj's or down's pending LoRA term, by rows split over
column groups: the decode route inside graphs.

A by-rows program (``kernels.rms_norm``) walks its row's 4096 columns of B alone, so the
term's loads sit on one SM each; the separate expand spreads them but is a launch more on the
critical path. Here a program covers one row and one group of columns: it adds its columns'
term (``row_lora_term``), then the residual, stores the summed columns and their partial sum
of squares. The last program of a row to finish (an atomic counter per row, in the device's
``kernels.norm_scratch``, whose hazards apply) sums the row's partial sums in group order and
normalises the row.

Hazards: the last program reads what the row's other programs stored. Each program's stores
are ordered before its counter increment by a barrier and the increment's release; the last
one's acquire orders its reads after them, and it reads through L2 (``.cg``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.fast_launch import launch
from kernels.norm_scratch import norm_scratch
from kernels.row_lora import row_lora_a, row_lora_term

TAIL_N = 1024
"""Columns the last program of a row normalises a step."""


@triton.jit
def _add_rms_norm_lora_split_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, part_ptr, count_ptr, n_rows, cols, eps,
    stride_x, stride_r, stride_o, stride_s, slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr,
    scal_ptr, max_rank: tl.constexpr, K: tl.constexpr, stride_s0: tl.constexpr,
    stride_s1: tl.constexpr, stride_as: tl.constexpr, stride_ar: tl.constexpr,
    stride_ak: tl.constexpr, stride_bs: tl.constexpr, stride_bn: tl.constexpr,
    stride_br: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr,
    SHRINK: tl.constexpr, BLOCK_K: tl.constexpr, NEUTRAL: tl.constexpr, BLOCK: tl.constexpr,
    GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, TAIL_N: tl.constexpr,
):
    """Grid (rows, ``GROUPS`` column groups of ``BLOCK``). ``part``: fp32 ``[GROUPS,
    n_rows]``; ``count``: int32 ``[n_rows]``, zero at launch and left zero."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    a, slot, live, scale = row_lora_a(
        slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr, max_rank, K, stride_s0,
        stride_s1, stride_as, stride_ar, stride_ak, row, 0, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
        NEUTRAL)
    offs = group * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + row_lora_term(a, b_ptr, slot, live, scale, offs, mask, stride_bs,
                                          stride_bn, stride_br, max_rank, BLOCK_R)).to(x.dtype)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    h = x.to(tl.float32)
    tl.store(part_ptr + group * n_rows + row, tl.sum(h * h, 0))
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if done == GROUPS - 1:
        g = tl.arange(0, GROUPS_P2)
        total = tl.sum(tl.load(part_ptr + g * n_rows + row, mask=g < GROUPS, other=0.0,
                               cache_modifier=".cg"), 0)
        tl.store(count_ptr + row, 0)  # left as found: the next launch's counter
        inv = tl.rsqrt(total / cols + eps)
        for c0 in range(0, cols, TAIL_N):  # fresh names: a loop may not retype a variable
            t_offs = c0 + tl.arange(0, TAIL_N)
            t_mask = t_offs < cols
            s = tl.load(sum_ptr + row * stride_s + t_offs, mask=t_mask, other=0.0,
                        cache_modifier=".cg")
            hn = (s.to(tl.float32) * inv).to(s.dtype).to(tl.float32)
            w = tl.load(w_ptr + t_offs, mask=t_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + t_offs, (w * hn).to(out_ptr.dtype.element_ty),
                     mask=t_mask)


def add_rms_norm_lora_split(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, out: torch.Tensor, summed: torch.Tensor,
                            term: tuple) -> None:
    """Writes ``norm(x + term + residual)`` to ``out`` and ``x + term + residual`` to
    ``summed``; ``term``: ``PendingLoRA.row_args()`` (one slice, ``SHRINK`` False)."""
    rows, cols = x.shape
    if not rows:
        return
    *lora, num_slices, block_r, shrink, block_k, neutral = term
    block = min(config.row_block_n(block_r), config.next_pow2(cols))
    groups = config.cdiv(cols, block)
    count, part = norm_scratch(x.device, rows, groups * rows)
    launch(_add_rms_norm_lora_split_kernel, (rows, groups),
        x, residual, weight, out, summed, part, count, rows, cols, eps, x.stride(0),
        residual.stride(0), out.stride(0), summed.stride(0), *lora, NUM_SLICES=num_slices,
        BLOCK_R=block_r, SHRINK=shrink, BLOCK_K=block_k, NEUTRAL=neutral, BLOCK=block,
        GROUPS=groups, GROUPS_P2=config.next_pow2(groups),
        TAIL_N=min(TAIL_N, config.next_pow2(cols)), num_warps=4)
