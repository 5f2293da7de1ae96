"""The residual add + RMSNorm that computes the next projection's LoRA shrink
(``kernels.rms_norm_shrink``): its norm and sum equal ``rms_norm``'s to the bit, and its ``a``
matches a float64 shrink of the normalised rows, zero past each row's rank, for random slots,
ranks, slices, static layouts with neutral padding rows, and with or without a LoRA delta."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, kernel_examples
from float64_reference import TOL, rel_err
from graph_harness import Harness, prefill_then_decode
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import defined_mask, linear_cases

import kernels.rms_norm_shrink as norm_shrink_module
from kernels import config
from kernels.lora_epilogue import LoRADelta
from kernels.rms_norm import rms_norm
from kernels.rms_norm_shrink import add_rms_norm_shrink
from lora_runtime.model.backend import use_base_backend

EXAMPLES = kernel_examples(gpu=30, cpu=8)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), with_delta=st.booleans(), seed=st.integers(0, 2**16))
def test_norm_shrink_matches_rms_norm_and_a_float64_shrink(dtype, data, with_delta, seed):
    case = data.draw(linear_cases(dtype, DEVICE))
    w = case.weights
    rows, k = len(case.token_slots), w.lora_a.shape[2]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    delta = (0.3 * torch.randn(rows, k, generator=g)).to(DEVICE) if with_delta else None
    weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    x_in = x.clone()
    out, summed, a = add_rms_norm_shrink(x, res, weight, 1e-5, delta, w, case.layout)
    assert torch.equal(x, x_in)
    want_out, want_sum = rms_norm(x, weight, 1e-5, res, None if delta is None else LoRADelta(delta))
    assert torch.equal(out, want_out) and torch.equal(summed, want_sum)

    assert a.shape == (rows, w.num_slices * w.max_rank) and a.dtype == torch.float32
    r = w.max_rank
    want = torch.zeros(rows, w.num_slices * r, dtype=torch.float64)
    a64 = w.lora_a.double().cpu()
    for t, slot in enumerate(case.token_slots):
        if slot == w.neutral_slot:
            continue
        for s in range(w.num_slices):
            n = int(w.ranks[slot, s])
            want[t, s * r: s * r + n] = a64[slot, s * r: s * r + n] @ out[t].double().cpu()
    defined = defined_mask(case)
    got = a.double().cpu()
    assert torch.equal(got[~defined], torch.zeros_like(got[~defined])), "a is zero past the rank"
    assert rel_err(got, want) <= TOL[torch.float32] * 10


@settings(max_examples=3, deadline=None)
@given(case=linear_cases(torch.float32, DEVICE))
def test_norm_shrink_refuses_a_stale_layout(case):
    w = case.weights
    rows, k = len(case.token_slots), w.lora_a.shape[2]
    x = torch.randn(rows + 1, k, device=DEVICE)
    weight = torch.ones(k, device=DEVICE)
    with pytest.raises(ValueError, match="covers .* rows but the input has"):
        add_rms_norm_shrink(x, x, weight, 1e-5, None, w, case.layout)


@pytest.mark.parametrize(("rows", "slices", "rank", "want"), [
    (16, 2, 16, 2), (64, 2, 16, 4), (256, 2, 64, 8), (1, 3, 1, 2), (4, 1, 8, 2)])
def test_norm_shrink_chunk_keeps_the_grid_full(rows, slices, rank, want):
    chunk = config.norm_shrink_chunk(rows, slices, rank)
    assert chunk == want
    assert chunk & (chunk - 1) == 0 and 2 <= chunk <= 8


def test_model_graphs_with_the_norm_shrink_match_the_oracle(monkeypatch):
    """Decode graphs of 4 rows (past the delta route's 2) under the Triton base kernels take
    gate_up's shrink from the norm before it; prefill graphs of 24 rows with the limit at 4
    do not. Every replay and eager forward matches the merged model."""
    monkeypatch.setattr(config, "NORM_SHRINK_MAX_ROWS", 4)
    calls, op = [], norm_shrink_module._add_rms_norm_shrink_op

    def counted(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    monkeypatch.setattr(norm_shrink_module, "_add_rms_norm_shrink_op", counted)
    with use_base_backend("triton"):
        h = Harness("triton", DEVICE, decode_buckets=[4], max_context=16, prefill_buckets=[24],
                    max_requests=4, slots=3, max_rank=8, dtype=torch.float32)
        # the graphs are captured (traced) here: the decode graph's layers took the route
        assert calls and set(calls) == {4}, calls
        captured = len(calls)
        ads = [h.adapter("A", 4, ["gate_proj", "up_proj", "o_proj"], seed=1),
               h.adapter("B", 8, ["up_proj", "down_proj", "q_proj"], seed=2),
               h.adapter("C", 2, ["gate_proj"], seed=3), None]

        def prefill_took_none():
            assert len(calls) == captured, "an eager forward or a prefill took the norm's shrink"

        prefill_then_decode(h, ads, DEVICE, prefill_bucket=24, decode_bucket=4,
                            after_prefill=prefill_took_none)
    assert h.replays == 3 and h.oracle_checks == 8
    assert len(calls) == captured, "replays run the captured graph, not the Python route"
