"""A float64 decode step written from the Llama definition (RMSNorm, rotary embedding with
Llama-3 frequency scaling, grouped-query attention, SwiGLU), for a few requests of a batch.

It shares nothing with the runtime's forward but the weights and the K/V the cache holds for
each request's context (the base-step suite fills the cache with noise, not with a prompt's
K/V): a fault in the base math that graph and eager share (an RMSNorm eps, a RoPE base, an
attention scale, a cache slot read for another request) shows here, where "replay == eager"
cannot see it. Weights are cast to float64 a block of rows at a time, so no float64 copy of
the model is ever held (the 32-layer 8B shapes would need 64 GB)."""

from __future__ import annotations

import math

import torch

CAST_ELEMENTS = 1 << 26
"""Weight elements cast to float64 at a time (512 MB): bounds the transient memory."""
TOL = {torch.float32: 1e-4, torch.float16: 0.25, torch.bfloat16: 0.25}
"""A checked row's relative error against float64. fp32: a correct runtime measures ~1e-6
(CPU profile). bf16: measured on a CPU (torch matmuls; hidden 1024, Llama-3 rotary, context
512): 0.011 / 0.015 / 0.024 at 2 / 4 / 8 layers, growing like sqrt(layers), so ~0.05 at 32;
RMSNorm eps x100 measured 0.67-0.78 and a RoPE base x2 0.89-1.0 at 4 layers. The bound sits
between (fp16 takes it too); on a GPU it is not yet measured, and each row records its
error (``max_rel_err_vs_float64``)."""
F64_CHECK = "first, middle and last request == a float64 decode step from the definition"


def check_against_f64(model, kv, requests, got: torch.Tensor, dtype, what: str) -> float:
    """Rows of ``got`` (the runtime's logits of ``requests``) for the first, a middle and the
    last request against ``decode_logits_f64``; raises ``AssertionError`` past ``TOL``.
    Returns the worst row's relative error."""
    picks = sorted({0, len(requests) // 2, len(requests) - 1})
    ref = decode_logits_f64(model, kv, [requests[i] for i in picks])
    rows = got[picks].double()
    err = ((rows - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).tolist()
    worst = max(err)
    if not worst <= TOL[dtype]:
        bad = {picks[i]: round(e, 4) for i, e in enumerate(err) if not e <= TOL[dtype]}
        raise AssertionError(f"{what}: requests {bad} differ from a float64 decode step "
                             f"written from the definition by more than {TOL[dtype]} (relative)")
    return worst


@torch.no_grad()
def decode_logits_f64(model, kv, requests) -> torch.Tensor:
    """Logits ``[len(requests), vocab]`` in float64 of each request's decode step: its last
    token at position ``len(kv_slots) - 1``, attending to the K/V cached at its other slots
    (``kv_slots[:-1]``) and to its own. ``model``: a Llama without a DP-sharded MLP (LoRA
    wrappers are read through to their base weights: the base model's logits)."""
    if model.dp is not None:
        raise ValueError("decode_logits_f64: the model's MLP is sharded for DP; pass an "
                         "unsharded model")
    cfg, m = model.config, model.model
    device = next(model.parameters()).device
    tokens = torch.tensor([r.last_token for r in requests], device=device)
    positions = [len(r.kv_slots) - 1 for r in requests]
    x = _weight(m.embed_tokens)[tokens].double()
    cos, sin = _rotary(cfg, positions, device)
    h_q, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i, layer in enumerate(m.layers):
        h = _rms(x, layer.input_layernorm)
        q, k, v = _linear(h, layer.self_attn.qkv_proj).split(
            [h_q * d, h_kv * d, h_kv * d], dim=-1)
        q = _rotate(q.reshape(-1, h_q, d), cos, sin)
        k = _rotate(k.reshape(-1, h_kv, d), cos, sin)
        v = v.reshape(-1, h_kv, d)
        out = torch.stack([
            _attend(q[j], kv.k[i], kv.v[i], r.kv_slots[:-1], k[j], v[j])
            for j, r in enumerate(requests)])
        x = x + _linear(out.reshape(len(requests), h_q * d), layer.self_attn.o_proj)
        h = _rms(x, layer.post_attention_layernorm)
        gate, up = _linear(h, layer.mlp.gate_up_proj).chunk(2, dim=-1)
        x = x + _linear(torch.nn.functional.silu(gate) * up, layer.mlp.down_proj)
    return _linear(_rms(x, m.norm), model.lm_head)


def _weight(module) -> torch.Tensor:
    return getattr(module, "base", module).weight


def _linear(x: torch.Tensor, module) -> torch.Tensor:
    w = _weight(module)
    rows = max(1, CAST_ELEMENTS // w.shape[1])
    return torch.cat([x @ w[lo : lo + rows].double().t() for lo in range(0, w.shape[0], rows)],
                     dim=-1)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


def _rotary(cfg, positions: list[int], device):
    """cos and sin ``[requests, 1, head_dim]`` (the two halves rotate together)."""
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


def _attend(q, k_cache, v_cache, slots, k_new, v_new) -> torch.Tensor:
    """One request's heads ``q [H, D]`` over its cached K/V and its own ``k_new, v_new``."""
    idx = torch.tensor(slots, dtype=torch.long, device=q.device)
    keys = torch.cat([k_cache[idx].double(), k_new[None]])  # [ctx, KV, D]
    values = torch.cat([v_cache[idx].double(), v_new[None]])
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,thd->ht", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("ht,thd->hd", scores.softmax(-1), values)
