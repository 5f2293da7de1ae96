"""Throughput verification compared the timed passes with the untimed pass only, so an engine
that gives a step's tokens to the wrong requests (the same way every pass) was verified, and
its tokens/s published. The untimed pass's tokens are now also checked against an eager
forward outside the engine (with a near-tie of 1e-3 in fp32, not 0.125), and a failed case
carries no timing."""

from __future__ import annotations

import torch

from bench import throughput_bench
from bench.context import Context
from bench.hardware import Ceilings
from lora_runtime.engine.engine import Engine

CTX = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
BASE = throughput_bench.cases("tiny", 1, "float32", 8, 3, 4, [(0, "-")], 4)[0]


def test_tokens_given_to_the_wrong_requests_fail_the_case(monkeypatch):
    real = Engine._take

    def rotated(self, plan, tokens, logits, samples):
        tokens = list(tokens)
        return real(self, plan, tokens[1:] + tokens[:1], logits, samples)

    monkeypatch.setattr(Engine, "_take", rotated)
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    row = throughput_bench.run_case(BASE, CTX)
    assert row["verification"]["status"] == "failed", row["verification"]
    assert "eager forward" in row["verification"]["error"]
    assert row["stats"] is None and row["derived"] == {}


def test_a_correct_engine_passes_the_reference(monkeypatch):
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    row = throughput_bench.run_case(BASE, CTX)
    assert row["verification"]["status"] == "verified", row["verification"]
    assert row["verification"]["reference_probes"] == 8 and row["stats"]["n"] == 1


def test_a_case_failing_in_its_timed_passes_publishes_no_timing(monkeypatch):
    real = Engine._take

    def rotated_when_timed(self, plan, tokens, logits, samples):
        tokens = list(tokens)
        if not self.keep_logits:  # the timed passes only
            tokens = tokens[1:] + tokens[:1]
        return real(self, plan, tokens, logits, samples)

    monkeypatch.setattr(Engine, "_take", rotated_when_timed)
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    row = throughput_bench.run_case(BASE, CTX)
    assert row["verification"]["status"] == "failed", row["verification"]
    assert row["stats"] is None and row["samples_us"] == [] and row["derived"] == {}


class _Model(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=dtype))


def test_judge_allows_rare_bf16_flips_but_no_fp32_one():
    from bench.token_reference import Found, judge

    one = Found([(3, 0, 7, 8)], 32)
    verified = {"status": "verified", "error": None, "checks": ["count"]}
    v = judge(one, _Model(torch.bfloat16), 0.125, verified)
    assert v["status"] == "verified" and v["reference_mismatches"] == 1
    assert v["checks"][0] == "count" and len(v["checks"]) == 2
    assert judge(one, _Model(torch.float32), 1e-3, verified)["status"] == "failed"
    many = Found([(i, 0, 1, 2) for i in range(5)], 32)  # a structural fault moves most probes
    assert judge(many, _Model(torch.bfloat16), 0.125, verified)["status"] == "failed"
