"""A float64 Llama forward written from the definition (RMSNorm, rotary embedding with Llama-3
frequency scaling, causal grouped-query attention, SwiGLU, LoRA as ``s * B @ A`` beside each
weight), for a few requests: the benchmarks' independent reference.

It shares nothing with the runtime's forward but the config (every constant is read from it,
not from the runtime's modules), the weights, the host adapters and, for a request with a
cached context, the K/V the cache holds at its slots (the base-step suite fills the cache
with noise, not with a prompt's K/V): a fault that graph and eager share (an RMSNorm
eps, a RoPE base, a scaling, a fused slice dropped, a cache slot read for another request)
shows here, where "replay == eager" cannot see it. Weights are cast to float64 a block of
rows at a time, so no float64 (or second) copy of the model is ever held: the 32-layer 8B
shapes would need 64 GB."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lora_runtime.lora.adapters import LoRAAdapter
from lora_runtime.model.modules import BY_NAME

CAST_ELEMENTS = 1 << 26
"""Weight elements cast to float64 at a time (512 MB): bounds the transient memory."""


@dataclass(frozen=True)
class Probe:
    """One request: ``tokens`` at positions ``len(cached)`` onwards, after the context whose
    K/V the cache holds at the slots ``cached``, served with ``adapter`` (None: the base)."""

    tokens: tuple[int, ...]
    cached: tuple[int, ...] = ()
    adapter: LoRAAdapter | None = None

    def __post_init__(self) -> None:
        if not self.tokens:  # its logits would be read from the row before it
            raise ValueError("Probe needs at least one token (its logits are the last "
                             f"token's), got tokens={self.tokens!r}")


@torch.no_grad()
def last_logits_f64(model, probes: list[Probe], kv=None) -> torch.Tensor:
    """Float64 logits ``[len(probes), vocab]`` at each probe's last token. ``model``: a Llama
    without a DP-sharded MLP (LoRA wrappers are read through to their base weights; adapters
    come from the probes). ``kv``: the cache ``cached`` slots are read from."""
    if model.dp is not None:
        raise ValueError("last_logits_f64: the model's MLP is sharded for DP; pass an "
                         "unsharded model")
    cfg, m = model.config, model.model
    device = next(model.parameters()).device
    bounds = [0]
    for p in probes:
        bounds.append(bounds[-1] + len(p.tokens))
    rows = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    ids = torch.tensor([t for p in probes for t in p.tokens], device=device)
    cos, sin = _rotary(cfg, [len(p.cached) + j for p in probes for j in range(len(p.tokens))],
                       device)
    x = _weight(m.embed_tokens)[ids].double()
    for r, p in zip(rows, probes, strict=True):
        e = (p.adapter.modules.get((None, "embed_tokens")) if p.adapter else None)
        if e is not None:  # PEFT's embedding: A [r, vocab], B [hidden, r]
            x[r] += e.scaling * e.a.to(device).double()[:, ids[r]].t() @ e.b.to(device).double().t()
    h_q, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms(x, layer.input_layernorm, cfg.rms_norm_eps)
        q, k, v = _linear(h, attn.qkv_proj, _terms(cfg, probes, rows, i, "qkv_proj")).split(
            [h_q * d, h_kv * d, h_kv * d], dim=-1)
        q = _rotate(q.reshape(-1, h_q, d), cos, sin)
        k = _rotate(k.reshape(-1, h_kv, d), cos, sin)
        v = v.reshape(-1, h_kv, d)
        out = torch.cat([_attend(q[r], k[r], v[r], kv.k[i] if p.cached else None,
                                 kv.v[i] if p.cached else None, p.cached)
                         for r, p in zip(rows, probes, strict=True)])
        x = x + _linear(out.reshape(-1, h_q * d), attn.o_proj,
                        _terms(cfg, probes, rows, i, "o_proj"))
        h = _rms(x, layer.post_attention_layernorm, cfg.rms_norm_eps)
        gate, up = _linear(h, mlp.gate_up_proj, _terms(cfg, probes, rows, i, "gate_up_proj")
                           ).chunk(2, dim=-1)
        x = x + _linear(torch.nn.functional.silu(gate) * up, mlp.down_proj,
                        _terms(cfg, probes, rows, i, "down_proj"))
    last = torch.tensor([b - 1 for b in bounds[1:]], device=device)
    one_each = [slice(j, j + 1) for j in range(len(probes))]
    return _linear(_rms(x[last], m.norm, cfg.rms_norm_eps), model.lm_head,
                   _terms(cfg, probes, one_each, None, "lm_head"))


def _terms(cfg, probes, rows, layer, module) -> list:
    """(rows, output columns, A, B, scaling) of each probe's adapter on ``module``."""
    out = []
    for r, p in zip(rows, probes, strict=True):
        for (at, name), lora in (p.adapter.modules.items() if p.adapter else ()):
            t = BY_NAME[name]
            if at == layer and t.module == module:
                widths = cfg.module_shape(module).slice_widths
                lo = sum(widths[: t.slice])
                out.append((r, slice(lo, lo + widths[t.slice]), lora.a, lora.b, lora.scaling))
    return out


def _weight(module) -> torch.Tensor:
    return getattr(module, "base", module).weight


def _linear(x: torch.Tensor, module, terms=()) -> torch.Tensor:
    w = _weight(module)
    step = max(1, CAST_ELEMENTS // w.shape[1])
    y = torch.cat([x @ w[lo : lo + step].double().t() for lo in range(0, w.shape[0], step)],
                  dim=-1)
    for r, cols, a, b, s in terms:
        y[r, cols] += s * (x[r] @ a.to(x.device).double().t()) @ b.to(x.device).double().t()
    return y


def _rms(x: torch.Tensor, norm, eps: float) -> torch.Tensor:
    """``eps`` from the config, not the runtime's module (``norm.eps``): an eps stored wrong
    when the runtime builds its norms would otherwise be shared by the reference."""
    return norm.weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotary(cfg, positions: list[int], device):
    """cos and sin ``[tokens, 1, head_dim]`` (the two halves rotate together)."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    rs = cfg.rope_scaling
    if rs is not None:  # Llama 3.1: long wavelengths slowed by `factor`, a ramp between
        lo, hi, old = rs["low_freq_factor"], rs["high_freq_factor"], \
            rs["original_max_position_embeddings"]
        out = []
        for f in inv.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / rs["factor"])
            else:
                ramp = (old / wavelen - lo) / (hi - lo)
                out.append((1 - ramp) * f / rs["factor"] + ramp * f)
        inv = torch.tensor(out, dtype=torch.float64)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :].to(device)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attend(q, k_new, v_new, k_cache, v_cache, cached) -> torch.Tensor:
    """One request's queries ``[n, H, D]`` over its cached K/V and its own, causally."""
    keys, values = k_new, v_new
    if cached:
        idx = torch.tensor(cached, dtype=torch.long, device=q.device)
        keys = torch.cat([k_cache[idx].double(), k_new])
        values = torch.cat([v_cache[idx].double(), v_new])
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,thd->hnt", q, keys) / math.sqrt(q.shape[-1])
    c = len(cached)
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= (
        c + torch.arange(q.shape[0], device=q.device))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), values)
