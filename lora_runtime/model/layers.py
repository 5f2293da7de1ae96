"""Llama building blocks: RMSNorm and rotary embeddings (Hugging Face numerics)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_runtime.model.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
