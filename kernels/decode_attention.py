"""Decode attention over the token-slot KV cache (flash-decoding): one query token per request,
K/V read in place through ``kv_indices``, never copied.

Grid: (request, KV head, split). One program serves every query head of its KV head (GQA:
the group's rows share each K/V tile it loads) over one slice of the request's context, and
writes an fp32 partial output with its log-sum-exp; a second kernel merges the splits. The
split count comes from shapes only (the capture-time batch and context), and each program
sizes its slice from the request's own length, read on the device: a graph captured at a
long context spreads a short request over all splits too, and programs past a request's
length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_q_and_kv_cache, checked_override, is_whole
from kernels.fast_launch import launch
from kernels.traced_op import traced_op

TILES = (64, 4, 2)
"""(block_n, num_warps, num_stages): keys per tile."""
BLOCK_N = TILES[0]
MAX_SPLITS = 32
MERGE_BLOCK = MAX_SPLITS
"""Splits the merge reads at once: one compiled variant for every heuristic split count."""


@triton.jit(do_not_specialize=["num_splits"])
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, lens_ptr, part_ptr, lse_ptr,
    sm_scale_log2, group, head_dim, num_splits,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ib,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    DIRECT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    # DIRECT (one split): part_ptr is the output itself, in its dtype; no log-sum-exp.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    if lo >= hi:
        return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kvh * group + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * stride_ib
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(idx_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    part = part_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    tl.store(part + offs_d[None, :], out.to(part_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])
    if not DIRECT:
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                 mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_ptr, lse_ptr, lens_ptr, out_ptr, head_dim, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # Splits that held no keys wrote nothing: their partials are never read.
    live = (offs_s < num_splits) & (offs_s * per_split < kv_len)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=live,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    part = tl.load(part_ptr + b.to(tl.int64) * stride_pb + h * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=live[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@traced_op("multilora::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
    kv_lens: torch.Tensor, sm_scale: float, splits: int, block_n: int, num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    bs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = q.new_empty(q.shape)
    if bs == 0:
        return out
    if splits == 1:  # one split: the partial is the output, no merge
        part, lse = out.view(bs, heads, 1, head_dim), out.new_empty(1, 1, 1, dtype=torch.float32)
    else:
        part = torch.empty(bs, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(bs, heads, splits, dtype=torch.float32, device=q.device)
    block_d = max(16, config.next_pow2(head_dim))
    launch(_decode_partial_kernel, (bs, kv_heads, splits),
        q, k_cache, v_cache, kv_indices, kv_lens, part, lse,
        sm_scale * 1.4426950408889634, group, head_dim, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), kv_indices.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        DIRECT=splits == 1, BLOCK_G=max(16, config.next_pow2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, PRECISION=config.dot_precision(q.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits == 1:
        return out
    launch(_decode_merge_kernel, (bs, heads),
        part, lse, kv_lens, out, head_dim, splits,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=max(MERGE_BLOCK, config.next_pow2(splits)), BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, kv_indices, kv_lens, sm_scale, splits, block_n, num_warps,
      num_stages):
    return torch.empty_like(q)


def decode_splits(bs: int, kv_heads: int, max_context: int, device: torch.device,
                  block_n: int = BLOCK_N) -> int:
    """Context splits per request, from shapes only: enough programs to cover the device twice
    (half of ``programs_wanted``: with more, the splits' short loops and the merge cost more
    than they hide; H200, bs=64 x 8 KV heads at context 512: one split 39.0 us, two 44.9),
    no split shorter than one key tile at the longest context the batch can hold."""
    want = -(-(config.programs_wanted(device) // 2) // max(1, bs * kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-max_context // block_n)))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
    kv_lens: torch.Tensor, sm_scale: float, splits: int | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``[bs, heads, head_dim]``: each request's query attends to the keys in
    ``kv_indices[b, :kv_lens[b]]`` (slots of ``k_cache``/``v_cache``, ``[slots, kv_heads,
    head_dim]``). Entries past ``kv_lens[b]`` are never read; ``kv_lens[b]`` must be >= 1.
    ``splits`` overrides the context-split heuristic and ``tiles`` = (block_n, num_warps,
    num_stages) the ``TILES`` default (tests, tuning)."""
    check(q.dim() == 3, lambda: f"q must be [bs, heads, head_dim], got shape {tuple(q.shape)}")
    bs = q.shape[0]
    kv_heads = check_q_and_kv_cache(q, k_cache, v_cache)
    check(kv_indices.dim() == 2 and kv_indices.shape[0] == bs and kv_indices.stride(1) == 1,
          lambda: f"kv_indices must be [{bs}, max_context] with contiguous rows, got shape "
          f"{tuple(kv_indices.shape)} strides {kv_indices.stride()}")
    check(tuple(kv_lens.shape) == (bs,) and (bs <= 1 or kv_lens.stride(0) == 1),
          lambda: f"kv_lens must be a contiguous [{bs}], got shape {tuple(kv_lens.shape)} "
          f"strides {kv_lens.stride()}")
    for name, t in (("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        check(t.dtype in (torch.int32, torch.int64) and t.device == q.device,
              lambda: f"{name} must be int32/int64 on {q.device}, got {t.dtype} on {t.device}")
    block_n, num_warps, num_stages = checked_tiles(tiles, TILES, ("block_n", "num_warps",
                                                                  "num_stages"))
    if splits is None:
        splits = decode_splits(bs, kv_heads, kv_indices.shape[1], q.device, block_n)
    # 0 once meant the heuristic and 2.5 ran as 2: an override is taken as given or refused.
    check(is_whole(splits) and 1 <= splits <= 4 * MAX_SPLITS, lambda: f"splits must be an "
          f"integer in [1, {4 * MAX_SPLITS}] (None: the heuristic), got {splits!r}")
    return _decode_attention_op(q, k_cache, v_cache, kv_indices, kv_lens, float(sm_scale),
                                int(splits), block_n, num_warps, num_stages)


def checked_tiles(tiles, default: tuple[int, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    """``tiles`` (None: ``default``) as Python ints, one per name: block sizes powers of two
    >= 16, num_warps a power of two, num_stages >= 1. A numpy integer failed inside the
    kernel, a float or a short tuple raised TypeError or "not enough values to unpack"."""
    if tiles is None:
        return default
    check(isinstance(tiles, (tuple, list)) and len(tiles) == len(names),
          lambda: f"tiles must be ({', '.join(names)}), got {tiles!r}")
    return tuple(_checked_tile(name, v) for name, v in zip(names, tiles, strict=True))


def _checked_tile(name: str, value) -> int:
    if name == "num_stages":
        check(is_whole(value) and value >= 1,
              lambda: f"num_stages must be an integer >= 1, got {value!r}")
        return int(value)
    return checked_override(name, value, 16 if name.startswith("block") else 1)
