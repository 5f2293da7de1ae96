"""Extend (prefill) attention over the token-slot KV cache: causal attention of each request's
new tokens over its own context (a cached prefix, then the new tokens), the batch packed.

Metadata is per request, cumulative: ``q_starts[i]..q_starts[i+1]`` are request i's rows of
the packed queries, ``kv_starts[i]..kv_starts[i+1]`` its context in ``kv_indices`` (key j at
position j), so its prefix is the context length minus its new tokens. Grid: (query block,
query head) with ``cdiv(T, BLOCK_M) + requests`` blocks, enough for any split of T rows into
that many requests; each program finds its request and block from ``q_starts`` on the device
and exits past the last one. Work therefore grows with each request's own length, and the
grid comes from shapes only (graph-safe). Keys below a block's first row's position are
read without a causal mask; only the diagonal tiles are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_q_and_kv_cache
from kernels.decode_attention import checked_tiles
from kernels.fast_launch import launch
from kernels.traced_op import traced_op

TILES = (64, 64, 4, 2)
"""(block_m, block_n, num_warps, num_stages): query rows and keys per tile."""
REQUEST_BLOCK = 64
"""Requests a program scans at a time to find its own (a constant: no variant per batch)."""


@triton.jit
def _attend(acc, m_i, l_i, q, k_ptr, v_ptr, idx_base, start, kv_end, pos, kvh, offs_d, d_mask,
            stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2,
            CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    slots = tl.load(idx_base + offs_n, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_requests"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, idx_ptr, q_starts_ptr, kv_starts_ptr,
    num_requests, sm_scale_log2, group, head_dim,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    # This block's request: the number of requests whose blocks all end at or before it
    # (BLOCK_R requests at a time, so one compiled variant serves any batch size).
    req = 0
    first_blk = 0
    done = 0
    for base in range(0, num_requests, BLOCK_R):
        offs_r = base + tl.arange(0, BLOCK_R)
        r_mask = offs_r < num_requests
        q_lo = tl.load(q_starts_ptr + offs_r, mask=r_mask, other=0)
        q_hi = tl.load(q_starts_ptr + offs_r + 1, mask=r_mask, other=0)
        blocks = tl.cdiv(q_hi - q_lo, BLOCK_M)
        before = (tl.cumsum(blocks, 0) + done) <= blk
        req += tl.sum(before.to(tl.int32), 0)
        first_blk += tl.sum(tl.where(before, blocks, 0), 0)
        done += tl.sum(blocks, 0)
    if req >= num_requests:
        return
    q_start = tl.load(q_starts_ptr + req)
    q_len = tl.load(q_starts_ptr + req + 1) - q_start
    kv_start = tl.load(kv_starts_ptr + req)
    prefix = tl.load(kv_starts_ptr + req + 1) - kv_start - q_len

    offs_m = (blk - first_blk) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows within the request
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    pos = prefix + offs_m  # each row sees keys 0..pos
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    idx_base = idx_ptr + kv_start
    first_pos = prefix + (blk - first_blk) * BLOCK_M
    kv_end = tl.minimum(first_pos + BLOCK_M, prefix + q_len)
    # Keys below full_end are seen by every row of the block: no causal mask there. Every
    # row (masked ones too) sees key 0, so no row's maximum stays -inf.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, idx_base, start, kv_end, pos,
                                kvh, offs_d, d_mask, stride_ks, stride_kh, stride_vs, stride_vh,
                                sm_scale_log2, False, BLOCK_N, PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, idx_base, start, kv_end, pos,
                                kvh, offs_d, d_mask, stride_ks, stride_kh, stride_vs, stride_vh,
                                sm_scale_log2, True, BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@traced_op("multilora::extend_attention", mutates_args=())
def _extend_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
    q_starts: torch.Tensor, kv_starts: torch.Tensor, sm_scale: float, block_m: int,
    block_n: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    t, heads, head_dim = q.shape
    requests = q_starts.shape[0] - 1
    # Rows outside every request are not written: zero them so nothing downstream sees NaN.
    out = q.new_zeros(q.shape)
    if t == 0 or requests == 0:
        return out
    grid = (config.cdiv(t, block_m) + requests, heads)
    launch(_extend_kernel, grid,
        q, k_cache, v_cache, out, kv_indices, q_starts, kv_starts,
        requests, sm_scale * 1.4426950408889634, heads // k_cache.shape[1], head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        BLOCK_R=REQUEST_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, config.next_pow2(head_dim)),
        PRECISION=config.dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out


@_extend_attention_op.register_fake
def _(q, k_cache, v_cache, kv_indices, q_starts, kv_starts, sm_scale, block_m, block_n,
      num_warps, num_stages):
    return torch.empty_like(q)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
    q_starts: torch.Tensor, kv_starts: torch.Tensor, sm_scale: float,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``[T, heads, head_dim]``: row ``q_starts[i] + j`` (request i's j-th new token) attends
    to ``kv_indices[kv_starts[i] : kv_starts[i] + prefix_i + j + 1]``, where ``prefix_i`` is
    request i's context length minus its new tokens. Rows past ``q_starts[-1]`` are zero.
    ``tiles`` = (block_m, block_n, num_warps, num_stages) overrides ``TILES`` (tuning)."""
    check(q.dim() == 3, lambda: f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    check_q_and_kv_cache(q, k_cache, v_cache)
    check(kv_indices.dim() == 1 and kv_indices.stride(0) == 1,
          lambda: f"kv_indices must be 1-D contiguous, got shape {tuple(kv_indices.shape)}")
    check(q_starts.dim() == 1 and q_starts.shape[0] >= 1 and kv_starts.shape == q_starts.shape,
          lambda: f"q_starts and kv_starts must be [requests + 1], got {tuple(q_starts.shape)} and "
          f"{tuple(kv_starts.shape)}; build the batch with build_extend")
    for name, x in (("kv_indices", kv_indices), ("q_starts", q_starts), ("kv_starts", kv_starts)):
        check(x.dtype in (torch.int32, torch.int64) and x.device == q.device and
              x.is_contiguous(), lambda: f"{name} must be contiguous int32/int64 on {q.device}, "
              f"got {x.dtype} on {x.device}")
    block_m, block_n, num_warps, num_stages = checked_tiles(
        tiles, TILES, ("block_m", "block_n", "num_warps", "num_stages"))
    return _extend_attention_op(q, k_cache, v_cache, kv_indices, q_starts, kv_starts,
                                float(sm_scale), block_m, block_n, num_warps, num_stages)
