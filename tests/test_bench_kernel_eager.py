"""The kernel suite's eager rows: a lone LoRA layer's eager route (one launch after the GEMM,
or shrink and expand around it) against the GEMM alone, judged against base + LoRA in fp32;
a route that drops the term fails the case instead of timing it."""

from __future__ import annotations

import pytest
import torch

from bench import kernel_bench
from bench.context import Context
from bench.hardware import Ceilings
from bench.kernel_bench import KernelCase, VerificationError
from kernels import config
from kernels.config import interpreted
from lora_runtime.lora.backends import TritonBackend

pytestmark = pytest.mark.skipif(not interpreted(), reason="Triton on CPU tensors needs "
                                "TRITON_INTERPRET=1")
CTX = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=2, profile="cpu")
CASE = KernelCase("tiny", "qkv_proj", 4, 2, 8, torch.float32)


@pytest.mark.parametrize("one_launch_rows", [config.ONE_LAUNCH_MAX_ROWS, 0],
                         ids=["one launch", "shrink and expand"])
def test_eager_rows_time_both_providers_alternating(monkeypatch, one_launch_rows):
    monkeypatch.setattr(config, "ONE_LAUNCH_MAX_ROWS", one_launch_rows)
    timed, err = kernel_bench._time_eager(CASE, CASE.token_slots()[0], CTX)
    assert set(timed) == {"module_eager", "base_eager"}
    assert err < 1e-5
    for timing, copies in timed.values():
        assert copies == 1 and len(timing.samples_us) == CTX.reps


def test_an_eager_route_dropping_the_term_fails_the_case(monkeypatch):
    monkeypatch.setattr(TritonBackend, "linear", lambda self, base, x, w, rows=None: base(x))
    with pytest.raises(VerificationError, match="module_eager output differs"):
        kernel_bench._time_eager(CASE, CASE.token_slots()[0], CTX)
    [row] = kernel_bench.run_case(CASE, CTX)
    assert row["provider"] == "module_eager" and row["verification"]["status"] == "failed"
    assert row["stats"] is None
