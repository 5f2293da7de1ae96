"""The base projection and its LoRA term in one launch, for forwards of at most 64 rows:
``y = x @ W^T + scaling[slot, s] * (x @ A[slot, s]^T) @ B[slot, cols of s]^T`` per row.

At decode the base GEMM streams W once and is bound by it; the separate LoRA path adds a
fork, a memset, a split-K shrink beside the GEMM and an expand after it (or a delta or a
pending term for the next kernel), each node a few us of latency on the step's critical path.
Here each program owns one tile of ``BLOCK_N`` output columns over every row and walks K.

The shrink is cut into tickets (one per (segment, slice, K part)), which programs claim with
an atomic counter: a program computes its ticket's partial ``a`` inside its own K loop from
the x tiles it loads anyway (the A tile load is masked off outside the ticket's K part), then
stores it to ``part``. Before its epilogue a program claims and computes leftover tickets,
then waits until every ticket is finished, sums ``a`` over the K parts and adds each row's
term, gathering B by the row's slot.

Hazards (invariants the kernel relies on):
- No deadlock whatever the scheduling: a program waits only for tickets already claimed, and
  only running programs claim; a ticket's work waits on nothing.
- ``sync`` (int32 [3]: claimed, finished, programs done) is zero at launch: the last program
  to finish resets it. Launches sharing one ``sync`` must be stream-ordered (one per module's
  weights: a module never runs on two streams at once).
- ``part`` is written by plain stores and read by other programs: the writer's CTA barrier
  plus a release increment of ``finished``, the reader's acquire load, and ``.cg`` loads
  (bypassing the non-coherent L1) order them.
- A ticket covers a slot's rows by ``token_slots`` (not by its block's rows), so only the
  first block of each slot's segment owns tickets.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check
from kernels.segments import SegmentLayout
from kernels.shrink import check_shrink_args
from kernels.traced_op import traced_op
from kernels.weights import LoRAWeights


@triton.jit
def _ticket(t, n_tickets, Q, k_per_q, blk_slot_ptr, ranks_ptr, NUM_SLICES: tl.constexpr):
    """(live, slot, slice, rank, k_lo, k_hi) of ticket ``t``: live when it is a real ticket
    of the first block of a slot's segment with a nonzero rank in its slice."""
    q = t % Q
    rest = t // Q
    sl = rest % NUM_SLICES
    blk = rest // NUM_SLICES
    real = t < n_tickets  # a layout may have no blocks at all: nothing is read for t past them
    slot = tl.load(blk_slot_ptr + blk, mask=real, other=0)
    prev = tl.load(blk_slot_ptr + tl.maximum(blk - 1, 0), mask=real, other=0)
    rank = tl.load(ranks_ptr + slot * NUM_SLICES + sl)
    live = real & (rank > 0) & ((blk == 0) | (prev != slot))
    return live, slot, sl, tl.where(live, rank, 0), q * k_per_q, q * k_per_q + k_per_q


@triton.jit
def _store_part(part_ptr, acc, q, sl, slot, slot_m, offs_m, m_mask, max_rank,
                stride_pq, stride_pm, BLOCK_R: tl.constexpr):
    offs_r = tl.arange(0, BLOCK_R)
    cols = sl * max_rank + offs_r
    ptrs = part_ptr + q * stride_pq + offs_m[:, None] * stride_pm + cols[None, :]
    tl.store(ptrs, acc, mask=(m_mask & (slot_m == slot))[:, None] & (offs_r < max_rank)[None, :])


@triton.jit
def _lora_gemm_kernel(
    x_ptr, w_ptr, y_ptr, la_ptr, lb_ptr, part_ptr, sync_ptr,
    tok_slot_ptr, blk_slot_ptr, ranks_ptr, scal_ptr, slice_off_ptr,
    M, N, K, max_rank, n_tickets, Q, k_per_q,
    stride_xm, stride_wn, stride_ym,
    stride_as, stride_ar, stride_bs, stride_bn, stride_br, stride_pq, stride_pm,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, RANK_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    slot_m = tl.load(tok_slot_ptr + offs_m, mask=m_mask, other=-1)

    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    live, slot, sl, rank, k_lo, k_hi = _ticket(t, n_tickets, Q, k_per_q, blk_slot_ptr,
                                               ranks_ptr, NUM_SLICES)
    a_base = la_ptr + slot.to(tl.int64) * stride_as + (sl * max_rank + offs_r)[None, :] * stride_ar
    r_ok = offs_r < rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None],
                     mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        in_part = k_mask & (ks >= k_lo) & (ks < k_hi)
        at = tl.load(a_base + ks[:, None], mask=in_part[:, None] & r_ok[None, :], other=0.0)
        a_acc = tl.dot(xt, at, a_acc, input_precision=PRECISION)
    if live:
        _store_part(part_ptr, a_acc, t % Q, sl, slot, slot_m, offs_m, m_mask, max_rank,
                    stride_pq, stride_pm, BLOCK_R)
    if t < n_tickets:
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")

    # Leftover tickets (more tickets than programs running), each computed on its own.
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while t < n_tickets:
        live, slot, sl, rank, k_lo, k_hi = _ticket(t, n_tickets, Q, k_per_q, blk_slot_ptr,
                                                   ranks_ptr, NUM_SLICES)
        if live:
            a_base = (la_ptr + slot.to(tl.int64) * stride_as
                      + (sl * max_rank + offs_r)[None, :] * stride_ar)
            part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(k_hi, K), BLOCK_K):
                ks = k0 + offs_k
                k_mask = (ks < K) & (ks < k_hi)
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                             mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_base + ks[:, None], mask=k_mask[:, None] & (offs_r < rank)[None, :],
                             other=0.0)
                part = tl.dot(xt, at, part, input_precision=PRECISION)
            _store_part(part_ptr, part, t % Q, sl, slot, slot_m, offs_m, m_mask, max_rank,
                        stride_pq, stride_pm, BLOCK_R)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed")

    finished = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    while finished < n_tickets:
        finished = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")

    # Epilogue: each row's term, B gathered by the row's slot, RANK_CHUNK ranks at a time.
    safe_slot = tl.where(m_mask, slot_m, 0)
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(slice_off_ptr + s)
        hi = tl.load(slice_off_ptr + s + 1)
        cols = n_mask & (offs_n >= lo) & (offs_n < hi)
        rank_m = tl.where(m_mask, tl.load(ranks_ptr + safe_slot * NUM_SLICES + s), 0)
        scale_m = tl.load(scal_ptr + safe_slot * NUM_SLICES + s)
        term = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in tl.static_range(0, BLOCK_R, RANK_CHUNK):
            offs_c = r0 + tl.arange(0, RANK_CHUNK)
            c_ok = offs_c[None, :] < rank_m[:, None]
            a = tl.zeros((BLOCK_M, RANK_CHUNK), dtype=tl.float32)
            for q in range(Q):
                a += tl.load(part_ptr + q * stride_pq + offs_m[:, None] * stride_pm
                             + (s * max_rank + offs_c)[None, :], mask=c_ok, other=0.0,
                             cache_modifier=".cg")
            a = a.to(lb_ptr.dtype.element_ty).to(tl.float32)  # rounded as the expand does
            b = tl.load(lb_ptr + safe_slot.to(tl.int64)[:, None, None] * stride_bs
                        + offs_n[None, :, None] * stride_bn + offs_c[None, None, :] * stride_br,
                        mask=c_ok[:, None, :] & cols[None, :, None], other=0.0)
            term += tl.sum(a[:, None, :] * b.to(tl.float32), axis=2)
        acc += term * scale_m[:, None]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    done = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:  # last one out: every claim is made, reset for the next
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)
        tl.atomic_xchg(sync_ptr + 2, 0)


@traced_op("multilora::lora_gemm", mutates_args=("sync",))
def _lora_gemm_op(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    sync: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
    slice_offsets: torch.Tensor, token_slots: torch.Tensor, block_slots: torch.Tensor,
    block_n: int, block_k: int, num_stages: int, num_warps: int,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    num_slices = slice_offsets.shape[0] - 1
    max_rank = lora_a.shape[1] // num_slices
    programs = config.cdiv(n, block_n)
    n_segments = block_slots.shape[0] * num_slices
    q = _k_parts(programs, n_segments, k, block_k)
    k_per_q = config.cdiv(config.cdiv(k, q), block_k) * block_k
    part = torch.empty(q, m, lora_a.shape[1], dtype=torch.float32, device=x.device)
    block_m = max(16, config.next_pow2(m))
    block_r = config.rank_block(max_rank)
    _lora_gemm_kernel[(programs,)](
        x, weight, y, lora_a, lora_b, part, sync, token_slots, block_slots, ranks, scalings,
        slice_offsets,
        m, n, k, max_rank, n_segments * q, q, k_per_q,
        x.stride(0), weight.stride(0), y.stride(0),
        lora_a.stride(0), lora_a.stride(1), *lora_b.stride(), part.stride(0), part.stride(1),
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_R=block_r, RANK_CHUNK=_rank_chunk(block_m, block_n, block_r),
        PRECISION=config.dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return y


@_lora_gemm_op.register_fake
def _(x, weight, lora_a, lora_b, sync, ranks, scalings, slice_offsets, token_slots,
      block_slots, block_n, block_k, num_stages, num_warps):
    return x.new_empty(x.shape[0], weight.shape[0])


def _rank_chunk(block_m: int, block_n: int, block_r: int) -> int:
    """Ranks per step of the epilogue's B gather (``[BLOCK_M, BLOCK_N, RANK_CHUNK]``):
    about 64 values a thread at 4 warps."""
    chunk = 1
    while chunk < block_r and block_m * block_n * chunk * 2 <= 8192:
        chunk *= 2
    return chunk


def _k_parts(programs: int, n_segments: int, k: int, block_k: int) -> int:
    """K parts per (segment, slice): enough tickets for every program to own about one,
    never more parts than K steps."""
    return max(1, min(programs // max(1, n_segments), config.cdiv(k, block_k)))


@functools.lru_cache(maxsize=256)
def launch_shape(m: int, n: int, k: int, max_rank: int, elt: int,
                 device: torch.device) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_stages, num_warps), from a sweep on the H200 (issue 11 notes):
    as many column tiles as SMs, wide K steps for few rows, stages within shared memory."""
    sms = config.sm_count(device.index or 0) if device.type == "cuda" else 132
    block_m = max(16, config.next_pow2(m))
    block_n = 128 if n // 128 >= sms else (64 if n // 64 >= 0.7 * sms else 32)
    block_k = min(128 if block_n == 128 or block_m == 64 else 256, max(16, config.next_pow2(k)))
    block_r = config.rank_block(max_rank)
    stage_bytes = elt * block_k * (block_m + block_n + block_r)
    num_stages = max(1, min(6 if block_n < 128 else 3, (176 * 1024) // stage_bytes))
    return block_n, block_k, num_stages, 8 if block_m == 64 and block_n == 64 else 4


def lora_gemm(x: torch.Tensor, weight: torch.Tensor, weights: LoRAWeights,
              layout: SegmentLayout | None, block_n: int | None = None,
              block_k: int | None = None, num_stages: int | None = None,
              num_warps: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` plus the LoRA term of each row's slot (``layout``), in one
    launch; at most ``config.LORA_GEMM_MAX_ROWS`` rows. The keyword arguments override the
    launch heuristics (tests, sweeps)."""
    what = "lora_gemm"
    check_shrink_args(x, weights, layout, what)
    check(x.shape[0] <= config.LORA_GEMM_MAX_ROWS,
          lambda: f"{what}: x has {x.shape[0]} rows, more than {config.LORA_GEMM_MAX_ROWS}; "
          "use the separate LoRA path")
    check(weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.stride(1) == 1,
          lambda: f"{what}: weight must be [out, {x.shape[1]}] with contiguous rows, got shape "
          f"{tuple(weight.shape)} strides {weight.stride()}")
    check(weight.dtype == x.dtype and weight.device == x.device,
          lambda: f"{what}: weight is {weight.dtype} on {weight.device}, x is {x.dtype} on "
          f"{x.device}")
    b = weights.lora_b
    check(b.shape[1] == weight.shape[0] and b.shape[2] == weights.max_rank,
          lambda: f"{what}: lora_b must be [slots, {weight.shape[0]}, {weights.max_rank}] (the "
          f"weight's out features, max_rank), got {tuple(b.shape)}")
    check(b.dtype == x.dtype and b.device == x.device,
          lambda: f"{what}: lora_b is {b.dtype} on {b.device}, x is {x.dtype} on {x.device}")
    shape = launch_shape(x.shape[0], weight.shape[0], x.shape[1], weights.max_rank,
                         x.element_size(), x.device)
    block_n, block_k, num_stages, num_warps = (
        o or d for o, d in zip((block_n, block_k, num_stages, num_warps), shape, strict=True))
    check(block_n >= 16 and block_k >= 16,
          lambda: f"{what}: block_n and block_k must be >= 16, got {block_n}, {block_k}")
    return _lora_gemm_op(
        x, weight, weights.lora_a, weights.lora_b, weights.gemm_sync(), weights.ranks,
        weights.scalings, weights.slice_offsets, layout.token_slots, layout.block_slots,
        block_n, block_k, num_stages, num_warps,
    )
