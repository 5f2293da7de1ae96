"""Rotary embedding of q and k fused with the KV-cache write: one launch reads a token's qkv
row once, writes its rotated q, and stores its rotated k and its v in the token's cache slot.
Torch takes a dozen launches for the same (two table gathers and casts, the rotate-half
``cat`` and four products per tensor, then two ``index_copy_``).

Neox-style rotation (Llama's ``rotate_half``, ``kernels.rotary``) with ``cos``/``sin`` tables
of ``head_dim`` columns whose two halves are equal.

With the qkv projection's pending or unshrunk LoRA term (``kernels.row_lora``, decode-sized
forwards) a program handles one head of one token, so that the B columns it adds spread over
the grid: a token-per-program grid would read a whole B row block (qkv: 6144 x rank) in one
program. An unshrunk term's program computes its slice's shrink over the whole K, so with
enough tokens to fill the device a program takes a group of heads of one slice
(``config.rope_heads_per_program``): one shrink serves them all. A pending term of more rows
goes by windows of rows instead (``kernels.rope_kv_windows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.checks import check, check_dtype
from kernels.fast_launch import launch
from kernels.lora_epilogue import LoRADelta, PendingLoRA
from kernels.rope_kv_windows import rope_kv_lora_windows_op
from kernels.rotary import q_out, rotate_halves
from kernels.row_lora import UnshrunkLoRA, row_lora_a, row_lora_term
from kernels.traced_op import traced_op


@triton.jit
def _load_heads(x_ptr, row_off, d_ptr, d_off, heads, half, HAS_DELTA: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Halves (lo, hi) of ``heads`` head vectors starting at ``x_ptr + row_off``; with
    ``HAS_DELTA`` the LoRA delta at ``d_ptr + d_off`` added, rounded as the expand rounds it."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < half)
    cols = offs_h[:, None] * (2 * half) + offs_d[None, :]
    lo = tl.load(x_ptr + row_off + cols, mask=mask, other=0.0)
    hi = tl.load(x_ptr + row_off + cols + half, mask=mask, other=0.0)
    if HAS_DELTA:
        d = d_ptr + d_off + cols
        lo = (lo.to(tl.float32) + tl.load(d, mask=mask, other=0.0)).to(lo.dtype)
        hi = (hi.to(tl.float32) + tl.load(d + half, mask=mask, other=0.0)).to(lo.dtype)
    return lo, hi, offs_h, offs_d, mask


@triton.jit
def _cos_sin(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, half, stride_tab, BLOCK_HALF: tl.constexpr):
    """Token ``t``'s half-width cos/sin rows, rounded to the activations' dtype as the model's
    torch RoPE rounds them, in float32; with the half offsets and their mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    dt = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_tab + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_tab + offs_d, mask=d_mask, other=0.0)
    return offs_d, d_mask, cos.to(dt).to(tl.float32), sin.to(dt).to(tl.float32)


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, loc_ptr, q_ptr, k_ptr, v_ptr, d_ptr,
                    heads, kv_heads, half, stride_qkv, stride_q, stride_k, stride_v,
                    stride_tab, stride_d, HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_d, d_mask, cos, sin = _cos_sin(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, half, stride_tab,
                                        BLOCK_HALF)
    cos, sin = cos[None, :], sin[None, :]
    row, d_row = t * stride_qkv, t * stride_d
    lo, hi, oh, od, m = _load_heads(qkv_ptr, row, d_ptr, d_row, heads, half, HAS_DELTA,
                                    BLOCK_H, BLOCK_HALF)
    lo, hi = rotate_halves(lo, hi, cos, sin)
    out = q_ptr + t * stride_q + oh[:, None] * (2 * half) + od[None, :]
    tl.store(out, lo, mask=m)
    tl.store(out + half, hi, mask=m)
    k_col = heads * 2 * half
    lo, hi, oh, od, m = _load_heads(qkv_ptr, row + k_col, d_ptr, d_row + k_col, kv_heads, half,
                                    HAS_DELTA, BLOCK_KV, BLOCK_HALF)
    lo, hi = rotate_halves(lo, hi, cos, sin)
    out = k_ptr + slot * stride_k + oh[:, None] * (2 * half) + od[None, :]
    tl.store(out, lo, mask=m)
    tl.store(out + half, hi, mask=m)
    v_col = k_col + kv_heads * 2 * half
    lo, hi, oh, od, m = _load_heads(qkv_ptr, row + v_col, d_ptr, d_row + v_col, kv_heads, half,
                                    HAS_DELTA, BLOCK_KV, BLOCK_HALF)
    dst = v_ptr + slot * stride_v + oh[:, None] * (2 * half) + od[None, :]
    tl.store(dst, lo, mask=m)
    tl.store(dst + half, hi, mask=m)


@triton.jit
def _head_with_lora(qkv_ptr, row_off, col, offs_d, d_mask, half, a, slot, live, scale,
                    b_ptr, stride_bs, stride_bn, stride_br, max_rank, BLOCK_R: tl.constexpr):
    """Halves (lo, hi) of the head vector at column ``col`` of a qkv row, its slice's LoRA
    term (``row_lora_a``'s ``a, slot, live, scale``) added and rounded as the expand rounds
    it."""
    ptr = qkv_ptr + row_off + col + offs_d
    lora = (b_ptr, slot, live, scale)
    strides = (stride_bs, stride_bn, stride_br)
    lo = tl.load(ptr, mask=d_mask, other=0.0)
    hi = tl.load(ptr + half, mask=d_mask, other=0.0)
    lo = (lo.to(tl.float32) + row_lora_term(a, *lora, col + offs_d, d_mask, *strides,
                                            max_rank, BLOCK_R)).to(lo.dtype)
    hi = (hi.to(tl.float32) + row_lora_term(a, *lora, col + half + offs_d, d_mask, *strides,
                                            max_rank, BLOCK_R)).to(lo.dtype)
    return lo, hi


@triton.jit
def _rope_kv_lora_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, loc_ptr, q_ptr, k_ptr, v_ptr,
                         heads, kv_heads, half, stride_qkv, stride_q, stride_k, stride_v,
                         stride_tab, slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr,
                         max_rank: tl.constexpr, K: tl.constexpr, stride_s0: tl.constexpr,
                         stride_s1: tl.constexpr, stride_as: tl.constexpr,
                         stride_ar: tl.constexpr, stride_ak: tl.constexpr,
                         stride_bs: tl.constexpr, stride_bn: tl.constexpr, stride_br: tl.constexpr,
                         NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr,
                         SHRINK: tl.constexpr, BLOCK_K: tl.constexpr, NEUTRAL: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, GROUP: tl.constexpr):
    """Grid (tokens, cdiv(heads, GROUP) + cdiv(kv_heads, GROUP)): the first programs rotate
    q heads, GROUP each; the others rotate k heads and copy v heads into the caches, GROUP
    each. A program computes (``SHRINK``) or loads its slices' ``a`` once for its heads. Head
    ``h``'s columns start at ``h * head_dim`` (k heads follow the q heads, v the k heads)."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs_d, d_mask, cos, sin = _cos_sin(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, half, stride_tab,
                                        BLOCK_HALF)
    lora = (slots_ptr, src_ptr, la_ptr, b_ptr, ranks_ptr, scal_ptr, max_rank, K, stride_s0,
            stride_s1, stride_as, stride_ar, stride_ak, t)
    b = (b_ptr, stride_bs, stride_bn, stride_br)
    row = t * stride_qkv
    q_programs = tl.cdiv(heads, GROUP)
    if p < q_programs:
        a, slot, live, scale = row_lora_a(*lora, 0, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
                                          NEUTRAL)
        for i in tl.static_range(GROUP):
            h = p * GROUP + i
            if h < heads:
                lo, hi = _head_with_lora(qkv_ptr, row, h * 2 * half, offs_d, d_mask, half, a,
                                         slot, live, scale, *b, max_rank, BLOCK_R)
                lo, hi = rotate_halves(lo, hi, cos, sin)
                out = q_ptr + t * stride_q + h * 2 * half + offs_d
                tl.store(out, lo, mask=d_mask)
                tl.store(out + half, hi, mask=d_mask)
    else:
        a, slot, live, scale = row_lora_a(*lora, 1, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
                                          NEUTRAL)
        a_v, _, _, scale_v = row_lora_a(*lora, 2, NUM_SLICES, BLOCK_R, SHRINK, BLOCK_K,
                                        NEUTRAL)
        cache_slot = tl.load(loc_ptr + t).to(tl.int64)
        for i in tl.static_range(GROUP):
            j = (p - q_programs) * GROUP + i
            if j < kv_heads:
                lo, hi = _head_with_lora(qkv_ptr, row, (heads + j) * 2 * half, offs_d, d_mask,
                                         half, a, slot, live, scale, *b, max_rank, BLOCK_R)
                lo, hi = rotate_halves(lo, hi, cos, sin)
                out = k_ptr + cache_slot * stride_k + j * 2 * half + offs_d
                tl.store(out, lo, mask=d_mask)
                tl.store(out + half, hi, mask=d_mask)
                v_lo, v_hi = _head_with_lora(qkv_ptr, row, (heads + kv_heads + j) * 2 * half,
                                             offs_d, d_mask, half, a_v, slot, live, scale_v,
                                             *b, max_rank, BLOCK_R)
                dst = v_ptr + cache_slot * stride_v + j * 2 * half + offs_d
                tl.store(dst, v_lo, mask=d_mask)
                tl.store(dst + half, v_hi, mask=d_mask)


def rope_and_cache_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, cache_loc: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, heads: int,
                      lora: PendingLoRA | UnshrunkLoRA | LoRADelta | None = None
                      ) -> torch.Tensor:
    """``qkv [T, (heads + 2 * kv_heads) * head_dim]`` -> rotated ``q [T, heads, head_dim]``;
    rotated k and v written to ``k_cache``/``v_cache`` (``[slots, kv_heads, head_dim]``) at
    the slots ``cache_loc [T]``, token by token. ``lora``: the qkv projection's LoRA term
    (three slices: q, k, v), pending, unshrunk or as a delta, added first."""
    check_dtype("qkv", qkv)
    check(k_cache.dim() == 3 and k_cache.device == qkv.device == v_cache.device,
          lambda: f"k_cache/v_cache must be [slots, kv_heads, head_dim] on {qkv.device} (qkv's "
          f"device), got {tuple(k_cache.shape)} on {k_cache.device} / {v_cache.device}")
    slots, kv_heads, head_dim = k_cache.shape
    t = qkv.shape[0]
    check(qkv.dim() == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
          and qkv.stride(-1) == 1,
          lambda: f"qkv has shape {tuple(qkv.shape)}; expected "
          f"[T, {(heads + 2 * kv_heads) * head_dim}] with contiguous rows ({heads} q heads + "
          f"2 x {kv_heads} KV heads of {head_dim})")
    check(head_dim % 2 == 0, lambda: f"head_dim must be even for rotary embeddings, got {head_dim}")
    check(v_cache.shape == k_cache.shape and k_cache.dtype == qkv.dtype == v_cache.dtype,
          lambda: f"k_cache/v_cache must share shape and the dtype of qkv ({qkv.dtype}), got "
          f"{tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    check(k_cache.stride(1) == head_dim and k_cache.stride(2) == 1
          and v_cache.stride(1) == head_dim and v_cache.stride(2) == 1,
          "k_cache/v_cache must hold each slot's heads contiguously")
    check(positions.shape == (t,) and cache_loc.shape == (t,),
          lambda: f"positions and cache_loc must have one entry per token ({t}), got "
          f"{tuple(positions.shape)} and {tuple(cache_loc.shape)}")
    for name, idx in (("positions", positions), ("cache_loc", cache_loc)):
        # The kernels read entry i at ``ptr + i``: a strided view would write other slots.
        check(idx.dtype in (torch.int32, torch.int64) and (t <= 1 or idx.stride(0) == 1),
              lambda: f"{name} must be a contiguous int32/int64 vector, got {idx.dtype} with "
              f"stride {idx.stride()}; pass {name}.contiguous()")
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim
          and cos.stride(1) == 1 and sin.stride() == cos.stride(),
          lambda: f"cos/sin tables must be [positions, {head_dim}] with contiguous rows")
    if lora is None or isinstance(lora, LoRADelta):
        if lora is not None:
            lora.check(qkv, "rope_and_cache_kv")
        return _rope_kv_op(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads,
                           None if lora is None else lora.delta)
    lora.check(qkv, "rope_and_cache_kv")
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    check(lora.weights.slice_widths == widths,
          lambda: f"rope_and_cache_kv: the LoRA term's slices {lora.weights.slice_widths} are "
          f"not q, k, v of {widths} columns")
    if not isinstance(lora, UnshrunkLoRA):
        if config.pending_by_windows(qkv, "rope"):
            return rope_kv_lora_windows_op(
                qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads,
                *lora.block_args(), config.wide_blocks(qkv.shape[0], lora.layout.block_m))
        if not config.pending_by_rows(qkv, "rope", lora.weights.max_rank,
                                      lora.weights.num_slots):
            # the separate expand, into a copy: qkv is an input
            return _rope_kv_op(lora.apply(qkv.clone()), positions, cos, sin, cache_loc,
                               k_cache, v_cache, heads)
    return _rope_kv_lora_op(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads,
                            *lora.row_args())


@traced_op("multilora::rope_and_cache_kv", mutates_args=("k_cache", "v_cache"))
def _rope_kv_op(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache_loc: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, heads: int,
                delta: torch.Tensor | None = None) -> torch.Tensor:
    q = q_out(qkv, k_cache, heads)
    t, kv_heads, half = qkv.shape[0], k_cache.shape[1], k_cache.shape[2] // 2
    if t:
        d = delta if delta is not None else qkv
        launch(_rope_kv_kernel, (t,),
            qkv, positions, cos, sin, cache_loc, q, k_cache, v_cache, d, heads, kv_heads, half,
            qkv.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0), cos.stride(0),
            d.stride(0), HAS_DELTA=delta is not None, BLOCK_H=config.next_pow2(heads),
            BLOCK_KV=config.next_pow2(kv_heads), BLOCK_HALF=config.next_pow2(half),
            num_warps=4)
    return q


@_rope_kv_op.register_fake
def _(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads, delta=None):
    return q_out(qkv, k_cache, heads)


@traced_op("multilora::rope_and_cache_kv_lora", mutates_args=("k_cache", "v_cache"))
def _rope_kv_lora_op(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache_loc: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, heads: int, slots: torch.Tensor, src: torch.Tensor,
                     la: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                     scalings: torch.Tensor, max_rank: int, K: int, s_s0: int, s_s1: int,
                     s_as: int, s_ar: int, s_ak: int, s_bs: int, s_bn: int, s_br: int,
                     NUM_SLICES: int, BLOCK_R: int, SHRINK: bool, BLOCK_K: int,
                     NEUTRAL: int) -> torch.Tensor:
    q = q_out(qkv, k_cache, heads)
    t, kv_heads, half = qkv.shape[0], k_cache.shape[1], k_cache.shape[2] // 2
    if t:
        group = config.rope_heads_per_program(t, heads, kv_heads) if SHRINK else 1
        grid = (t, config.cdiv(heads, group) + config.cdiv(kv_heads, group))
        launch(_rope_kv_lora_kernel, grid,
            qkv, positions, cos, sin, cache_loc, q, k_cache, v_cache, heads, kv_heads, half,
            qkv.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0), cos.stride(0),
            slots, src, la, b, ranks, scalings, max_rank, K, s_s0, s_s1, s_as, s_ar, s_ak,
            s_bs, s_bn, s_br, NUM_SLICES=NUM_SLICES, BLOCK_R=BLOCK_R, SHRINK=SHRINK,
            BLOCK_K=BLOCK_K, NEUTRAL=NEUTRAL, BLOCK_HALF=config.next_pow2(half), GROUP=group,
            num_warps=config.row_shrink_warps() if SHRINK else 2)
    return q


@_rope_kv_lora_op.register_fake
def _(qkv, positions, cos, sin, cache_loc, k_cache, v_cache, heads, *args):
    return q_out(qkv, k_cache, heads)
