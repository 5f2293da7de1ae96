"""gate_up's expand inside SwiGLU's activation (``kernels/lora_epilogue.py``): the fused kernel
against float64 and against the separate expand followed by the activation, on random
layouts (decode and prefill rows, the neutral slot, rank-0 slices, padding rows of a static
view); then the model with the fused path forced on, eager and in graph replays, against the
merged-model oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from float64_reference import TOL, lora_delta_f64, rel_err
from graph_harness import Harness
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.silu_mul as silu_module
from kernels import (
    LoRAWeights,
    SegmentLayout,
    StaticSegmentLayout,
    config,
    lora_shrink,
    plan_segments,
)
from kernels.lora_epilogue import PendingLoRA
from kernels.silu_mul import silu_mul
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.model.backend import use_base_backend

EXAMPLES = 25 if ON_GPU else 8


def _weights(g, slots: int, k: int, inter: int, max_rank: int, dtype) -> LoRAWeights:
    w = LoRAWeights.for_linear(slots, k, [inter, inter], max_rank, dtype, DEVICE)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * k**-0.5)
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g) * max_rank**-0.5)
    w.ranks[:slots] = torch.randint(0, max_rank + 1, (slots, 2), generator=g, dtype=torch.int32)
    w.scalings[:slots] = torch.rand(slots, 2, generator=g) + 0.5
    return w


def _layout(plan, rows: int, padded: int, slots: int):
    if padded == rows:
        return SegmentLayout.from_plan(plan, DEVICE)
    static = StaticSegmentLayout(padded, slots + 1, plan.block_m, slots, DEVICE)
    static.write(plan, padded)
    return static.view(padded)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_fused_silu_mul_matches_expand_then_activation(dtype, data, seed):
    g = torch.Generator().manual_seed(seed)
    slots = data.draw(st.integers(1, 4))
    max_rank = data.draw(st.sampled_from([4, 16, 32] + ([64] if ON_GPU else [])))
    inter = data.draw(st.sampled_from([16, 40, 136] + ([1000] if ON_GPU else [])))
    k = 32
    # request slots; slot `slots` is the neutral one
    requests = data.draw(st.lists(st.integers(0, slots), min_size=1, max_size=40))
    lens = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 5), min_size=len(requests),
                                                   max_size=len(requests))))
    plan = plan_segments(requests, lens, block_m=16, skip_slot=slots)
    rows = plan.num_rows
    padded = rows + data.draw(st.integers(0, 7))
    layout = _layout(plan, rows, padded, slots)
    token_slots = plan.token_slots + [slots] * (padded - rows)
    w = _weights(g, slots, k, inter, max_rank, dtype)
    x = torch.randn(padded, k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(padded, 2 * inter, generator=g).to(dtype).to(DEVICE)
    a = lora_shrink(x, w, layout)
    # Hazard poison: what the shrink leaves undefined must never reach the output.
    neutral = torch.tensor([s == slots for s in token_slots], dtype=torch.bool, device=DEVICE)
    a[neutral] = float("nan")
    for slot in range(slots):
        rows_of = torch.tensor([s == slot for s in token_slots], dtype=torch.bool,
                               device=DEVICE)
        for sl in range(2):
            r = int(w.ranks[slot, sl])
            a[rows_of, sl * max_rank + r: (sl + 1) * max_rank] = float("nan")
    got = silu_mul(y, PendingLoRA(a, w, layout))
    assert got.shape == (padded, inter) and torch.isfinite(got).all()
    want = silu_mul(PendingLoRA(a, w, layout).apply(y.clone()))
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    gu = y.double().cpu() + lora_delta_f64(x, w, token_slots)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert rel_err(got, ref) <= 4 * TOL[dtype]


def test_fused_silu_mul_refuses_a_term_of_another_projection():
    g = torch.Generator().manual_seed(0)
    plan = plan_segments([0, 1], block_m=16)
    layout = SegmentLayout.from_plan(plan, DEVICE)
    w = LoRAWeights.for_linear(2, 8, [24], 16, torch.float32, DEVICE)
    a = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="not gate and up"):
        silu_mul(torch.randn(2, 24, generator=g).to(DEVICE), PendingLoRA(a, w, layout))
    w2 = _weights(g, 2, 8, 12, 16, torch.float32)
    with pytest.raises(ValueError, match="a must be float32"):
        silu_mul(torch.randn(2, 24, device=DEVICE), PendingLoRA(a, w2, layout))
    with pytest.raises(ValueError, match="covers 2 rows"):
        silu_mul(torch.randn(3, 24, device=DEVICE), PendingLoRA(torch.zeros(3, 32), w2, layout))


@pytest.mark.slow
def test_model_with_the_fused_expand_matches_the_oracle_eager_and_replayed(monkeypatch):
    """Forced on for every row count, under the Triton base kernels: eager forwards and graph
    replays (decode and prefill buckets) equal each other and the merged model."""
    monkeypatch.setattr(config, "FUSED_EXPAND_MIN_ROWS", 0)
    calls = []
    op = silu_module._silu_mul_lora_op
    monkeypatch.setattr(silu_module, "_silu_mul_lora_op", lambda *a: calls.append(1) or op(*a))
    with use_base_backend("triton"):
        h = Harness("triton", DEVICE, decode_buckets=[4], max_context=16, prefill_buckets=[24],
                    max_requests=4, slots=3, max_rank=8, dtype=torch.float32)
        ads = [h.adapter("A", 4, ["gate_proj", "up_proj", "o_proj"], seed=1),
               h.adapter("B", 8, ["up_proj", "down_proj", "q_proj"], seed=2), None]
        reqs = [Request(list(range(1, 2 + 3 * i)), None if ad is None else ad.name, 8)
                for i, ad in enumerate(ads)]
        logits = h.step(build_extend(reqs, h.runner.kv, DEVICE), expect_bucket=24)
        for _ in range(2):
            for r, ad, row in zip(reqs, ads, logits, strict=True):
                h.oracle(r.tokens, ad, row)
                r.output.append(int(row.argmax()))
            logits = h.step(build_decode(reqs, h.runner.kv, DEVICE), expect_bucket=4)
        release(reqs, h.runner.kv)
    assert h.replays == 3 and h.oracle_checks == 6
    assert calls, "the fused activation never ran"
