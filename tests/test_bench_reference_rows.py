"""The float64 checks read three rows of a batch (the base step: first, middle, last; the model
suite: the first of each adapter and the last) and the model suite checked only its LoRA
traffic, so a fault confined to another request (the third request of 4 decoding one position
off) was verified in every suite of the CPU profile. Batches of up to ``ALL_ROWS`` now have
every row checked, larger ones ``ALL_ROWS`` spread rows, and every traffic of the model suite
(base traffic, the runtime without LoRA) is checked."""

from __future__ import annotations

import pytest
import torch
from bench_faults import third_request_one_position_off

import bench.model_runtime as model_runtime
from bench.context import Context
from bench.hardware import Ceilings
from bench.model_bench import ModelCase, RuntimeCache, run_case

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")


@pytest.mark.parametrize("adapters", [0, 2], ids=["no-lora", "lora"])
@pytest.mark.parametrize("fault", [False, True], ids=["correct", "third-request-off"])
def test_model_suite_checks_every_row(monkeypatch, adapters, fault):
    if fault:
        third_request_one_position_off(monkeypatch, model_runtime)
    case = ModelCase("decode", "tiny", 1, 8, 4, adapters, (4,) if adapters else (), "torch",
                     torch.float32)
    rows = run_case(case, CTX, RuntimeCache([case], CPU))
    v = rows[0]["verification"]
    if fault:
        assert v["status"] == "failed" and "requests {2:" in v["error"], v
    else:
        assert {r["verification"]["status"] for r in rows} == {"verified"}
        assert all(r["verification"]["max_rel_err_vs_float64"] < 1e-5 for r in rows)


def test_picks():
    from bench.reference_checks import ALL_ROWS, _lora_picks, _spread

    assert _spread(4, {0, 2, 3}) == [0, 1, 2, 3]
    big = _spread(256, {0, 128, 255})
    assert len(big) == ALL_ROWS and {0, 128, 255} <= set(big)
    names = ["a", "b", "a", None] * 64
    picks = _lora_picks(names)
    assert len(picks) == ALL_ROWS and {0, 1, 3, 128, 255} <= set(picks)
