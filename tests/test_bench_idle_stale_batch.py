"""The idle suite's check must see an idle forward that keeps the previous step's LoRA batch
(neither ``ForwardBatch.idle`` nor the forward's own preparation resetting it): it only ran
idle forwards in a runtime where no LoRA batch had been prepared, so the check could not
tell, and the case was verified. It now leaves a LoRA batch prepared before each idle
forward, as a DP rank's last step with rows does."""

from __future__ import annotations

import torch

from bench import idle_bench
from bench.context import Context
from bench.hardware import Ceilings
from lora_runtime.engine import forward_batch
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.lora.manager import LoRAManager

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
CASES = idle_bench.cases("tiny", 2, "float32", 16, (1,), 2, 8)
IDLE = CASES[0]
real_idle = ForwardBatch.idle
real_prepare = LoRAManager.prepare_lora_batch


def _idle_keeping_the_batch(lora_manager, device, gathered=None):
    return real_idle(None, device, gathered)  # no reset of the LoRA batch


def _prepare_keeping_the_batch(self, batch):
    if batch.mode is not ForwardMode.IDLE:
        real_prepare(self, batch)


def test_an_idle_forward_that_keeps_the_lora_batch_fails_the_case(monkeypatch):
    monkeypatch.setattr(forward_batch.ForwardBatch, "idle", staticmethod(_idle_keeping_the_batch))
    monkeypatch.setattr(LoRAManager, "prepare_lora_batch", _prepare_keeping_the_batch)
    rows = idle_bench.run_case(IDLE, CTX, idle_bench.RuntimePair(CASES, CPU))
    assert len(rows) == 1
    assert rows[0]["verification"]["status"] == "failed" and rows[0]["stats"] is None


def test_a_correct_idle_forward_passes():
    rows = idle_bench.run_case(IDLE, CTX, idle_bench.RuntimePair(CASES, CPU))
    assert rows and all(r["verification"]["status"] == "verified" for r in rows)
