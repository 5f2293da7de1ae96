"""The base step's launchers read their index and weight vectors at ``ptr + i``: a strided
view (or float indices) is refused with a message naming it, never read as if contiguous
(a strided ``cache_loc`` wrote K/V into other slots, the scratch slot among them)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kernels.decode_attention import decode_attention
from kernels.decode_inputs import write_decode_inputs
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv


def _column(values, dtype=torch.long):
    """``values`` as a strided view (stride 2): column 0 of a two-column tensor."""
    return torch.tensor([[v, 0] for v in values], dtype=dtype, device=DEVICE)[:, 0]


def _rope_inputs():
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, hd = 3, 2, 1, 8
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=g).to(DEVICE)
    angles = torch.arange(32).double()[:, None] * torch.rand(hd // 2, generator=g).double()
    cos, sin = (f(angles).repeat(1, 2).float().to(DEVICE) for f in (torch.cos, torch.sin))
    cache = torch.zeros(20, kv_heads, hd, device=DEVICE)
    return qkv, cos, sin, cache, heads


@pytest.mark.parametrize("bad", ["positions", "cache_loc", "float positions"])
def test_rope_refuses_strided_or_float_indices(bad):
    qkv, cos, sin, cache, heads = _rope_inputs()
    pos = torch.tensor([1, 2, 3], device=DEVICE)
    loc = torch.tensor([5, 9, 13], device=DEVICE)
    if bad == "positions":
        pos = _column([1, 2, 3])
    elif bad == "cache_loc":
        loc = _column([5, 9, 13])
    else:
        pos = pos.float()
    k, v = cache.clone(), cache.clone()
    name = bad.split()[-1]
    with pytest.raises(ValueError, match=f"{name} must be a contiguous int32/int64 vector"):
        rope_and_cache_kv(qkv, pos, cos, sin, loc, k, v, heads)
    assert torch.equal(k, cache) and torch.equal(v, cache), "nothing written before the error"


def test_decode_attention_refuses_strided_lengths():
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(50, 1, 16, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(2, 2, 16, generator=g).to(DEVICE)
    table = torch.arange(1, 41, device=DEVICE).reshape(2, 20)
    with pytest.raises(ValueError, match="kv_lens must be a contiguous"):
        decode_attention(q, k, v, table, _column([3, 17]), 0.25)


@pytest.mark.parametrize("bad", ["strided", "dtype"])
def test_rms_norm_refuses_a_strided_or_mistyped_weight(bad):
    x = torch.randn(3, 8, device=DEVICE)
    w = torch.randn(16, device=DEVICE)[::2] if bad == "strided" else torch.ones(8, device=DEVICE,
                                                                                 dtype=torch.long)
    with pytest.raises(ValueError, match="weight must be a contiguous floating-point vector"):
        rms_norm(x, w, 1e-5)


def test_decode_write_refuses_strided_sources():
    dst = tuple(torch.zeros(4, dtype=torch.long, device=DEVICE) for _ in range(4)) + (
        torch.zeros(4, 8, dtype=torch.long, device=DEVICE),)
    src = [torch.ones(2, dtype=torch.long, device=DEVICE) for _ in range(4)] + [
        torch.ones(2, 3, dtype=torch.long, device=DEVICE)]
    src[0] = _column([11, 12])
    before = [t.clone() for t in dst]
    with pytest.raises(ValueError, match="contiguous vectors"):
        write_decode_inputs(dst, tuple(src), 2, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))
