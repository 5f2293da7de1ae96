"""Attention over the token-slot KV cache: the Triton kernels (and the torch reference) against
float64, then the model with Triton attention inside graph replays.

Kernel cases draw lengths, GQA ratios (1, 2, 4, 8 query heads per KV head), prefixes from none
to long, padding rows and zero-row batches; table entries a kernel must not read point at a
slot full of NaN. On a CPU the kernels run in the Triton interpreter (fp32/fp16, few examples).
"""

from __future__ import annotations

import pytest
import torch
from attention_f64 import RequestRows, attention_f64
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU, kernel_examples
from float64_reference import TOL, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import GraphRunner
from kernels.decode_attention import decode_attention
from kernels.extend_attention import REQUEST_BLOCK, extend_attention
from lora_runtime.engine.forward_batch import DecodeAttention, ExtendAttention, ForwardBatch
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.model.attention_ops import decode_attention_reference, extend_attention_reference
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

EXAMPLES = kernel_examples(gpu=12, cpu=6)
SLOTS = 1024
POISON = SLOTS - 1  # holds NaN: any read of it shows in the output


def _cache(kv_heads: int, head_dim: int, dtype, g: torch.Generator):
    k = torch.randn(SLOTS, kv_heads, head_dim, generator=g)
    v = torch.randn(SLOTS, kv_heads, head_dim, generator=g)
    k[POISON] = v[POISON] = float("nan")
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)


def _slots(n: int, g: torch.Generator) -> list[int]:
    return (torch.randperm(POISON - 1, generator=g)[:n] + 1).tolist()


@st.composite
def shapes(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([32, 128] if ON_GPU else [16, 32]))
    return kv_heads, group, head_dim


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(shape=shapes(), data=st.data())
def test_decode_matches_float64(provider, dtype, shape, data):
    kv_heads, group, head_dim = shape
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    bs = data.draw(st.integers(0, 5))
    max_len = 600 if ON_GPU else 130
    lens = data.draw(st.lists(st.integers(1, max_len), min_size=bs, max_size=bs))
    ctx = max(lens, default=1) + data.draw(st.integers(0, 70))  # a graph's wider table
    splits = data.draw(st.sampled_from([None, 1, 3, 8]))
    tiles = data.draw(st.sampled_from([None, (16, 4, 1), (128, 8, 3)]))
    k_cache, v_cache = _cache(kv_heads, head_dim, dtype, g)
    q = torch.randn(bs, kv_heads * group, head_dim, generator=g).to(dtype).to(DEVICE)
    contexts = [_slots(n, g) for n in lens]
    table = torch.full((bs, ctx), POISON, dtype=torch.long)
    for b, c in enumerate(contexts):
        table[b, : len(c)] = torch.tensor(c)
    meta = DecodeAttention(table.to(DEVICE), torch.tensor(lens, dtype=torch.long, device=DEVICE))
    scale = head_dim**-0.5
    if provider == "triton":
        out = decode_attention(q, k_cache, v_cache, meta.kv_indices, meta.kv_lens, scale, splits,
                               tiles)
    else:
        meta.kv_indices[meta.kv_indices == POISON] = KVCache.SCRATCH  # it reads the padding
        out = decode_attention_reference(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    ref = attention_f64(q, k_cache, v_cache,
                        [RequestRows([b], c) for b, c in enumerate(contexts)], scale)
    assert rel_err(out, ref) < TOL[dtype] if bs else out.numel() == 0


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(shape=shapes(), data=st.data())
def test_extend_matches_float64(provider, dtype, shape, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    n = data.draw(st.integers(0, 4))
    big = 300 if ON_GPU else 50
    new = data.draw(st.lists(st.integers(1, big), min_size=n, max_size=n))
    prefix = data.draw(st.lists(st.sampled_from([0, 1, 7, 64, big]), min_size=n, max_size=n))
    padding = data.draw(st.integers(0, 9))
    tiles = data.draw(st.sampled_from([None, (16, 32, 4, 1), (32, 16, 2, 3)]))
    _check_extend(provider, dtype, shape, g, new, prefix, padding, tiles)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[-1:], ids=str)
def test_extend_finds_requests_past_one_request_block(dtype):
    """More requests than the kernel scans at a time (``REQUEST_BLOCK``): each program still
    finds its own request, in every block of requests."""
    g = torch.Generator().manual_seed(5)
    n = REQUEST_BLOCK + 5
    new = torch.randint(1, 3, (n,), generator=g).tolist()
    prefix = torch.randint(0, 5, (n,), generator=g).tolist()
    _check_extend("triton", dtype, (1, 1, 16), g, new, prefix, 3, (16, 16, 4, 1))


def _check_extend(provider, dtype, shape, g, new, prefix, padding, tiles):
    kv_heads, group, head_dim = shape
    k_cache, v_cache = _cache(kv_heads, head_dim, dtype, g)
    t = sum(new) + padding
    q = torch.randn(t, kv_heads * group, head_dim, generator=g).to(dtype).to(DEVICE)
    reqs, row, q_starts, kv_starts, kv_idx = [], 0, [0], [0], []
    token_req, kv_req, kv_pos = [], [], []
    for i, (m, p) in enumerate(zip(new, prefix, strict=True)):
        ctx = _slots(p + m, g)
        reqs.append(RequestRows(list(range(row, row + m)), ctx))
        row += m
        q_starts.append(row)
        kv_starts.append(kv_starts[-1] + p + m)
        kv_idx += ctx
        token_req += [i] * m
        kv_req += [i] * (p + m)
        kv_pos += range(p + m)
    long = lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE)  # noqa: E731
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    meta = ExtendAttention(long(token_req + [-1] * padding), long(kv_idx + [0] * padding),
                           long(kv_req + [-1] * padding), long(kv_pos + [0] * padding),
                           int32(q_starts), int32(kv_starts))
    positions = long([p + j for p, m in zip(prefix, new, strict=True) for j in range(m)]
                     + [0] * padding)
    scale = head_dim**-0.5
    if provider == "triton":
        out = extend_attention(q, k_cache, v_cache, meta.kv_indices, meta.q_starts,
                               meta.kv_starts, scale, tiles)
    else:
        out = extend_attention_reference(q, k_cache, v_cache, meta, positions, scale)
    assert out.shape == q.shape and out.dtype == dtype
    if t == 0:
        return
    ref = attention_f64(q, k_cache, v_cache, reqs, scale)
    real = sum(new)
    assert rel_err(out[:real], ref[:real]) < TOL[dtype] if real else True
    if provider == "triton":
        assert torch.equal(out[real:].cpu(), torch.zeros_like(out[real:]).cpu()), \
            "rows of no request must be zero"
    else:
        assert torch.isfinite(out[real:]).all(), "padding rows must stay finite"


def test_launchers_name_the_fix():
    q = torch.randn(2, 4, 16, device=DEVICE)
    k = torch.randn(8, 3, 16, device=DEVICE)
    lens = torch.ones(2, dtype=torch.long, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, k, table, lens, 1.0)
    k = torch.randn(8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="keep the KV cache in the model dtype"):
        decode_attention(q, k.half(), k.half(), table, lens, 1.0)
    with pytest.raises(ValueError, match=r"kv_indices must be \[2, max_context\]"):
        decode_attention(q, k, k, table[:1], lens, 1.0)
    for splits in (0, 2.5, True):  # 0 ran the heuristic, 2.5 as 2
        with pytest.raises(ValueError, match="splits must be an integer"):
            decode_attention(q, k, k, table, lens, 1.0, splits)
    starts = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="build_extend"):
        extend_attention(q, k, k, table[0], starts, starts[:2], 1.0)
    for v in (k[:, :1], k[:2]):  # fewer KV heads or slots: read past v_cache
        with pytest.raises(ValueError, match=r"and v_cache .* differ"):
            extend_attention(q, k, v.contiguous(), table[0], starts[:2], starts[:2], 1.0)


# -- the model, Triton attention inside graph replays -----------------------------------------

@pytest.fixture(scope="module")
def served():
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    model = LlamaForCausalLM.random(tiny(2), dtype, DEVICE, seed=3)
    runner = ModelRunner(model, KVCache(model.config, 512, dtype, DEVICE), None)
    with use_base_backend("triton"):
        decode = GraphRunner.decode(runner, [1, 4], max_context=40).capture()
        prefill = GraphRunner.prefill(runner, [16, 32], max_requests=3, max_prefix=40).capture()
    return runner, decode, prefill, dtype


def _check(runner: ModelRunner, graph: GraphRunner, batch: ForwardBatch, dtype) -> torch.Tensor:
    """Replay == eager Triton == eager torch reference (same KV writes each time)."""
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    got = graph.replay(batch).clone()
    with use_base_backend("triton"):
        eager = runner.forward_eager(batch)
    with use_base_backend("torch"):
        ref = runner.forward_eager(batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, eager, rtol=tol, atol=tol, msg=lambda m: f"replay: {m}")
    torch.testing.assert_close(eager, ref, rtol=tol, atol=tol, msg=lambda m: f"eager: {m}")
    return got


def test_model_graph_replays_with_triton_attention(served):
    runner, decode, prefill, dtype = served
    kv = runner.kv
    reqs = [Request(list(range(1, 1 + n)), None, 64) for n in (5, 11, 2)]
    logits = _check(runner, prefill, build_extend(reqs, kv, DEVICE), dtype)
    for r, row in zip(reqs, logits, strict=True):
        r.output.append(int(row.argmax()))
    for n in (3, 1, 3):  # crosses buckets: padding rows in the bs=4 graph
        logits = _check(runner, decode, build_decode(reqs[:n], kv, DEVICE), dtype)
        for r, row in zip(reqs[:n], logits, strict=True):
            r.output.append(int(row.argmax()))
        for r in reqs[n:]:
            r.output.append(7)  # not decoded: extended below, after its cached prefix
        if n < len(reqs):
            logits = _check(runner, prefill, build_extend(reqs[n:], kv, DEVICE), dtype)
            for r, row in zip(reqs[n:], logits, strict=True):
                r.output.append(int(row.argmax()))
    idle = decode.replay(ForwardBatch.idle(None, DEVICE))
    assert idle.shape[0] == 0
    assert torch.isfinite(decode.graphs[("base", 1)].replay()).all(), "idle replay is not neutral"
    # chunked-prefill style continuation: a long prefix, several new tokens
    reqs[0].output += [3, 4, 5, 6, 7, 8]
    _check(runner, prefill, build_extend(reqs[:1], kv, DEVICE), dtype)
    release(reqs, kv)


def test_decode_tables_are_as_wide_as_the_longest_context_with_aligned_rows():
    """Graph buckets choose by the table's width (the longest context), the kernels compile
    per divisibility class of its row stride: width exact, stride a multiple of 16."""
    kv = KVCache(tiny(1), 64, torch.float32, DEVICE)
    reqs = [Request([1] * n, None, 4) for n in (3, 17)]
    build_extend(reqs, kv, DEVICE)
    for r in reqs:
        r.output.append(5)
    table = build_decode(reqs, kv, DEVICE).attn.kv_indices
    assert table.shape == (2, 18) and table.stride() == (32, 1)
    assert table[0, 4:].eq(KVCache.SCRATCH).all() and table[1].ne(KVCache.SCRATCH).all()
    release(reqs, kv)
