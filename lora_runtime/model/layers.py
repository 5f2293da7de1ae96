"""Llama building blocks: RMSNorm (fused with the residual add before it), rotary embeddings
fused with the KV-cache write, SwiGLU's activation. Hugging Face numerics; each runs the Triton
kernel or the torch reference by ``lora_runtime.model.backend``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.lora_epilogue import LoRADelta, PendingLoRA
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv
from kernels.row_lora import UnshrunkLoRA
from kernels.silu_mul import silu_mul as silu_mul_triton
from kernels.traced_op import tracing
from lora_runtime.model.backend import base_backend
from lora_runtime.model.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: LoRADelta | PendingLoRA | UnshrunkLoRA | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``. ``lora``:
        the previous projection's LoRA term, as a delta (``LoRABackend.linear_delta``),
        pending (``linear_deferred``) or unshrunk (``linear_unshrunk``), added to ``x``
        first."""
        if base_backend(x.device, x.dtype) == "triton":
            return rms_norm(x, self.weight, self.eps, residual, lora)
        if lora is not None:
            x = lora.apply(x)
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, x)


# The LoRA wrappers' methods are found by a class lookup: no Module.__getattr__ on the plain
# nn.Linear path.
def deferred(projection: nn.Module, x: torch.Tensor):
    """``(projection(x), None)``, or where ``projection`` is a LoRA wrapper that may leave its
    term to the next kernel, ``(base output, its LoRA term or None)``."""
    if hasattr(type(projection), "forward_deferred"):
        return projection.forward_deferred(x)
    return projection(x), None


def silu_mul(gate_up: torch.Tensor, lora=None) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` of ``gate_up = [gate | up]``. ``lora``: the
    gate_up projection's pending LoRA term (``kernels.lora_epilogue.PendingLoRA``), added
    first: inside the Triton kernel, or by the expand before the torch version."""
    if base_backend(gate_up.device, gate_up.dtype) == "triton":
        return silu_mul_triton(gate_up, lora)
    if lora is not None:
        gate_up = lora.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, gathered by ``positions`` (no per-batch Python)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        shape = (config.max_position_embeddings, config.head_dim)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        self.fill()

    @torch.no_grad()
    def fill(self) -> None:
        """(Re)computes the tables in place, e.g. after ``Module.to_empty``."""
        inv = inverse_frequencies(self.config)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        emb = torch.outer(t, inv).repeat(1, 2)
        if self.cos.device.type != "meta":
            self.cos.copy_(emb.cos())
            self.sin.copy_(emb.sin())

    def forward(self, positions, q, k):
        """q: [T, H, D], k: [T, KV, D]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_and_cache(self, qkv, positions, cache_loc, k_cache, v_cache, heads: int,
                         lora=None):
        """``qkv [T, (heads + 2 KV) * D]`` -> rotated ``q [T, heads, D]``; rotated k and v
        written to the caches at ``cache_loc``. ``lora``: the qkv projection's pending LoRA
        term (``kernels.lora_epilogue.PendingLoRA``), added first: inside the Triton kernel,
        or by the expand before the torch version.

        On CPU tensors positions outside the table and cache slots outside the caches are
        refused (``ValueError``) before anything is written; on a GPU that check would sync a
        launch (the engine refuses such requests in ``add_request``)."""
        if qkv.device.type == "cpu" and not tracing():
            _check_inside("positions", positions, self.cos.shape[0], "the rotary table",
                          " (max_position_embeddings)")
            _check_inside("cache_loc", cache_loc, k_cache.shape[0], "the KV cache's slots", "")
        if base_backend(qkv.device, qkv.dtype) == "triton":
            return rope_and_cache_kv(qkv, positions, self.cos, self.sin, cache_loc, k_cache,
                                     v_cache, heads, lora)
        if lora is not None:
            qkv = lora.apply(qkv)
        t, (kv_heads, d) = qkv.shape[0], k_cache.shape[1:]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = self(positions, q.reshape(t, heads, d), k.reshape(t, kv_heads, d))
        k_cache.index_copy_(0, cache_loc, k)
        v_cache.index_copy_(0, cache_loc, v.reshape(t, kv_heads, d))
        return q


def _check_inside(name: str, index: torch.Tensor, size: int, what: str, note: str) -> None:
    """Outside ``0..size-1`` the Triton kernel read or wrote past the tensor (a segfault
    under the interpreter) and torch indexing wrapped -1 to the last row, silently."""
    if index.numel() == 0 or index.dtype.is_floating_point or index.dtype == torch.bool:
        return  # no index to check (the kernels name a wrong dtype)
    lo, hi = (int(v) for v in torch.aminmax(index))  # ~2 us a layer; the mask below ~12
    if lo >= 0 and hi < size:
        return
    bad = index[(index < 0) | (index >= size)]
    raise ValueError(f"{name} {bad[:5].tolist()} are outside {what} 0..{size - 1}{note}: "
                     "refuse such tokens before the forward")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
