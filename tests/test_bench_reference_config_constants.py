"""The float64 reference read the RMSNorm eps from the runtime's norm modules (``norm.eps``),
so an eps stored wrong when the runtime builds its norms (``RMSNorm.__init__``) was shared by
the reference, and the base step and the model suite's LoRA rows were verified with it
(measured: eps x100 verified in both suites of the CPU profile). The reference now takes its
constants from the config."""

from __future__ import annotations

import pytest
import torch

from bench import base_step_suite
from bench.context import Context
from bench.hardware import Ceilings
from bench.model_bench import ModelCase, RuntimeCache
from bench.model_bench import run_case as run_model_case
from lora_runtime.model import layers

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")


def _eps_stored_x100(monkeypatch):
    real = layers.RMSNorm.__init__

    def init(self, size, eps):
        real(self, size, eps * 100)

    monkeypatch.setattr(layers.RMSNorm, "__init__", init)


@pytest.mark.parametrize("fault", [False, True], ids=["correct", "eps-stored-x100"])
def test_base_step_rows(monkeypatch, fault):
    if fault:
        _eps_stored_x100(monkeypatch)
    case = base_step_suite.cases("tiny", 1, "float32", (3,), (16,), ("torch",))[0]
    v = base_step_suite.make_runner([case], CTX)(case)[0]["verification"]
    assert v["status"] == ("failed" if fault else "verified"), v
    if fault:
        assert "float64 decode step" in v["error"]


@pytest.mark.parametrize("fault", [False, True], ids=["correct", "eps-stored-x100"])
def test_model_suite_lora_rows(monkeypatch, fault):
    if fault:
        _eps_stored_x100(monkeypatch)
    case = ModelCase("prefill", "tiny", 1, 8, 2, 2, (4,), "torch", torch.float32)
    rows = run_model_case(case, CTX, RuntimeCache([case], CPU))
    status = {r["verification"]["status"] for r in rows}
    assert status == ({"failed"} if fault else {"verified"}), rows[0]["verification"]
