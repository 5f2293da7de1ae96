"""Suite "base_step": a replay is checked against eager before it is timed; one that differs
is failed and not timed."""

from __future__ import annotations

import torch

from bench import base_step_suite
from bench.context import Context
from bench.hardware import Ceilings
from graphs import GraphRunner

CTX = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=2, profile="cpu")
CASES = base_step_suite.cases("tiny", 1, "float32", (1, 3), (16,), ("torch",))


def test_replays_are_verified_then_timed_with_their_floors():
    run = base_step_suite.make_runner(CASES, CTX)
    for case in CASES:
        [row] = run(case)
        assert row["verification"]["status"] == "verified", row["verification"]
        assert row["stats"]["n"] == CTX.reps
        d = row["derived"]
        assert d["roofline_floor_us"] >= d["bytes_floor_us"] > 0 and d["pct_of_roofline"] > 0
        assert row["batch_size"] == case.batch_size and row["kernels"] == "torch"


def test_a_replay_off_eager_is_failed_and_not_timed(monkeypatch):
    real = GraphRunner.replay
    monkeypatch.setattr(GraphRunner, "replay", lambda self, b, **kw: real(self, b, **kw) + 1.0)
    [row] = base_step_suite.make_runner(CASES[:1], CTX)(CASES[0])
    assert row["verification"]["status"] == "failed"
    assert "graph replay vs eager" in row["verification"]["error"]
    assert row["stats"] is None
