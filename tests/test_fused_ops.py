"""The base step's fused kernels (RMSNorm with the residual add, RoPE with the KV-cache write,
SwiGLU's activation) against float64 definitions and against the torch reference they replace.
Random shapes (odd hidden sizes, GQA ratios, zero rows); cache slots a kernel must not write
hold NaN and must keep it."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU, kernel_examples
from float64_reference import TOL, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.lora_epilogue import LoRADelta
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv
from kernels.silu_mul import silu_mul
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import tiny
from lora_runtime.model.layers import RMSNorm, RotaryEmbedding
from lora_runtime.model.layers import silu_mul as silu_mul_dispatch

EXAMPLES = kernel_examples(gpu=20, cpu=6)


def _randn(*shape, g, dtype):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(rows=st.integers(0, 9), hidden=st.sampled_from([8, 48, 100, 4096 if ON_GPU else 160]),
       with_residual=st.booleans(), with_delta=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm(dtype, rows, hidden, with_residual, with_delta, seed):
    """With a LoRA delta (float32, added to x first) and without."""
    g = torch.Generator().manual_seed(seed)
    x, res = _randn(rows, hidden, g=g, dtype=dtype), _randn(rows, hidden, g=g, dtype=dtype)
    delta = 0.3 * _randn(rows, hidden, g=g, dtype=torch.float32) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    x_in, delta_in = x.clone(), None if delta is None else delta.clone()
    got = rms_norm(x, w, 1e-5, res if with_residual else None,
                   None if delta is None else LoRADelta(delta))
    assert torch.equal(x, x_in) and (delta is None or torch.equal(delta, delta_in))
    s64 = (x.double() + (0 if delta is None else delta.double())
           + (res.double() if with_residual else 0))
    want = w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = got[0] if with_residual else got
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert rel_err(out, want) <= 2 * TOL[dtype]
    if with_residual:
        assert rel_err(got[1], s64) <= TOL[dtype]
    norm = RMSNorm(hidden, 1e-5).to(dtype).to(DEVICE)
    norm.weight.data.copy_(w)
    with use_base_backend("torch"):
        ref = norm(x, res if with_residual else None, None if delta is None else LoRADelta(delta))
    ref_out = ref[0] if with_residual else ref
    torch.testing.assert_close(out, ref_out, rtol=TOL[dtype], atol=TOL[dtype])


def _rope_f64(x, pos, inv_freq):
    """Rotate-half RoPE from its definition, float64: x [T, H, D], pos [T]."""
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    half = x.shape[-1] // 2
    lo, hi = x.double()[..., :half], x.double()[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(t=st.integers(0, 7), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([8, 32, 128] if ON_GPU else [8, 16]), seed=st.integers(0, 2**16))
def test_rope_and_cache_kv(dtype, t, kv_heads, group, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    config = tiny(1)
    config = type(config)(**{**config.__dict__, "head_dim": head_dim})
    rotary = RotaryEmbedding(config).to(DEVICE)
    heads, slots = kv_heads * group, 32
    qkv = _randn(t, (heads + 2 * kv_heads) * head_dim, g=g, dtype=dtype)
    pos = torch.randint(0, config.max_position_embeddings, (t,), generator=g).to(DEVICE)
    loc = (torch.randperm(slots - 1, generator=g)[:t] + 1).to(DEVICE)
    caches = [torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
              for _ in range(4)]
    q = rope_and_cache_kv(qkv, pos, rotary.cos, rotary.sin, loc, caches[0], caches[1], heads)
    with use_base_backend("torch"):
        q_ref = rotary.rotate_and_cache(qkv, pos, loc, caches[2], caches[3], heads)
    q_in, k_in, v_in = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2).double() / head_dim))
    assert rel_err(q, _rope_f64(q_in.reshape(t, heads, head_dim).cpu(), pos.cpu(), inv)) \
        <= 2 * TOL[dtype]
    assert rel_err(caches[0][loc], _rope_f64(k_in.reshape(t, kv_heads, head_dim).cpu(),
                                             pos.cpu(), inv)) <= 2 * TOL[dtype]
    assert torch.equal(caches[1][loc], v_in.reshape(t, kv_heads, head_dim))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert caches[0][untouched].isnan().all() and caches[1][untouched].isnan().all()
    torch.testing.assert_close(q, q_ref, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(caches[0][loc], caches[2][loc], rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(rows=st.integers(0, 6), inter=st.sampled_from([4, 40, 1500]), seed=st.integers(0, 2**16))
def test_silu_mul(dtype, rows, inter, seed):
    g = torch.Generator().manual_seed(seed)
    x = _randn(rows, 2 * inter, g=g, dtype=dtype)
    got = silu_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    assert got.shape == (rows, inter)
    assert rel_err(got, gate * torch.sigmoid(gate) * up) <= 2 * TOL[dtype]
    with use_base_backend("torch"):
        ref = silu_mul_dispatch(x)
    torch.testing.assert_close(got, ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_bad_inputs_are_named():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight has shape \(4,\)"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, x[:1])
    for bad in (x.half(), torch.zeros(1, 8, device=DEVICE), torch.zeros(8, 2, device=DEVICE).t()):
        with pytest.raises(ValueError, match="delta must be float32"):
            rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, x, LoRADelta(bad))
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(torch.randn(2, 7, device=DEVICE))
    cache = torch.zeros(4, 1, 8, device=DEVICE)
    tab = torch.zeros(16, 8, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv has shape \(2, 8\)"):
        rope_and_cache_kv(x, ids, tab, tab, ids, cache, cache, 2)


def test_rms_norm_accepts_an_empty_delta_whatever_its_strides():
    """``0.3 * torch.randn(0, 1)`` has strides (1, 0): an empty delta was refused as
    non-contiguous."""
    x, res = torch.randn(0, 8, device=DEVICE), torch.randn(0, 8, device=DEVICE)
    delta = torch.empty_strided((0, 8), (1, 0), device=DEVICE)
    out, summed = rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, res, LoRADelta(delta))
    assert out.shape == summed.shape == (0, 8)
