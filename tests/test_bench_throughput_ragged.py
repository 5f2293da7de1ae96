"""The throughput suite's workloads have one prompt and one output length, so every decode
batch holds one context length and fills its graph bucket: padding rows that write their K/V
into a live request's slot, or a decode attention masking every request by the longest
context, were verified (never run). Each runtime now also serves an untimed ragged workload
(drawn lengths), checked against an eager forward with its logits rows."""

from __future__ import annotations

import pytest
import torch
from bench_faults import mask_by_longest

from bench import throughput_bench
from bench.context import Context
from bench.hardware import Ceilings
from graphs.static_batch import DecodeBuffers

CTX = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
BASE = throughput_bench.cases("tiny", 1, "float32", 8, 4, 4, [(0, "-")], 4)[0]


def _padding_writes_a_live_slot(monkeypatch):
    real = DecodeBuffers.write_by_torch

    def write(self, b, n, bucket):
        real(self, b, n, bucket)
        if 0 < n < bucket:  # into the first request's first context slot, not scratch
            self.out_cache_loc[n:bucket] = self.kv_indices[0, 0]

    monkeypatch.setattr(DecodeBuffers, "write_by_torch", write)


@pytest.mark.parametrize("fault", [None, "padding-writes-a-live-slot", "mask-by-longest"])
def test_a_ragged_workload_is_verified(monkeypatch, fault):
    if fault == "padding-writes-a-live-slot":
        _padding_writes_a_live_slot(monkeypatch)
    elif fault == "mask-by-longest":
        mask_by_longest(monkeypatch)
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    row = throughput_bench.run_case(BASE, CTX)
    v = row["verification"]
    if fault is None:
        assert v["status"] == "verified", v
        assert v["ragged_max_rel_err_logits_vs_eager"] < 1e-5
    else:
        assert v["status"] == "failed" and "ragged workload" in v["error"], v
        assert row["stats"] is None
