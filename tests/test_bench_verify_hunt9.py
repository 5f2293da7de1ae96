"""Faults a ninth hunt injected into the benchmark suites' CPU cases, each one that a suite
verified and published before its check was fixed."""

from __future__ import annotations

import pytest
import torch

from bench import dp_bench, dp_suite, idle_bench, kernel_bench, model_bench, throughput_bench
from bench.context import Context
from bench.hardware import Ceilings
from bench.kernel_bench import KernelCase, VerificationError, make_weights
from graphs.static_batch import DecodeBuffers
from kernels import SegmentLayout, plan_segments
from kernels.reference import expand_reference, shrink_reference
from lora_runtime.engine.engine import Engine
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import PRESETS

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
VOCAB = PRESETS["tiny"](1).vocab_size
_real_take = Engine._take


def _take_off_when_logits_not_kept(self, plan, tokens, logits, samples):
    """The last row of a step of 2 or more takes the next token id, only where the engine
    keeps no logits (the DP suite's timed passes; its untimed pass keeps them)."""
    if not self.keep_logits and len(tokens) >= 2:
        tokens = [*tokens[:-1], (tokens[-1] + 1) % VOCAB]
    return _real_take(self, plan, tokens, logits, samples)


def _faulty_dp_rank(rank, size, opts, out):
    Engine._take = _take_off_when_logits_not_kept  # in the spawned rank's own process
    dp_bench.run_rank(rank, size, opts, out)


def test_a_dp_case_whose_timed_passes_give_wrong_tokens_is_failed(monkeypatch):
    """The DP suite counted the timed passes' tokens and checked only the untimed pass's
    values: timed passes giving a request wrong tokens were verified and timed."""
    real_spawn = dp_suite.spawn
    monkeypatch.setattr(dp_suite, "spawn", lambda fn, *a, **k: real_spawn(_faulty_dp_rank, *a,
                                                                            **k))
    case = dp_suite.cases("tiny", 1, "float32", (1,), ("skewed",), (0,), 8,
                          {"requests_per_rank": 2, "prompt": 6, "output": 3,
                           "max_batch": 2})[0]
    [row] = dp_suite.make_runner([case], CTX)(case)
    v = row["verification"]
    assert v["status"] == "failed", v
    assert "timed pass" in v["error"] and row["stats"] is None


BF16_PREFILL = KernelCase("tiny", "down_proj", 2048, 4, 8, torch.bfloat16)


def _reference_kernels(monkeypatch, skip_last_row: bool) -> None:
    """The kernel suite's shrink and expand as the torch references (the interpreter's bf16
    is wrong), the expand leaving the batch's last row without its term where asked (a
    kernel masking rows against ``T - 1``)."""
    def expand(a, w, y, layout):
        last = y[-1].clone()
        expand_reference(a, w, y, layout)
        if skip_last_row:
            y[-1] = last

    monkeypatch.setattr(kernel_bench, "lora_shrink", shrink_reference)
    monkeypatch.setattr(kernel_bench, "lora_expand", expand)


def _check(case: KernelCase) -> dict:
    slots, lens = case.token_slots()
    plan = plan_segments(slots, lens, block_m=case.block_m)
    layout = SegmentLayout.from_plan(plan, CPU)
    x = torch.randn(case.tokens, case.shape.in_features, dtype=case.dtype)
    return kernel_bench._check(case, make_weights(case, CPU), x, layout, plan.token_slots)


def test_a_kernel_wrong_on_one_row_of_a_bf16_prefill_fails_the_check(monkeypatch):
    """The check's relative error was the whole output's: one row of 2048 without its term
    read 0.022, under bf16's 0.03, and the case was verified and timed."""
    torch.manual_seed(0)
    _reference_kernels(monkeypatch, skip_last_row=True)
    with pytest.raises(VerificationError, match="row 2047"):
        _check(BF16_PREFILL)


def test_a_correct_bf16_prefill_passes_the_row_check(monkeypatch):
    torch.manual_seed(0)
    _reference_kernels(monkeypatch, skip_last_row=False)
    errs = _check(BF16_PREFILL)
    assert errs["triton"] < 0.25 * kernel_bench.CHECK_TOL[torch.bfloat16], errs


def test_a_module_schedule_wrong_on_one_row_of_a_bf16_prefill_fails(monkeypatch):
    """The module rows' check (the output after the timed replays against base + LoRA) was
    over the whole output too: the last row left at the GEMM's output read 0.02."""
    torch.manual_seed(0)
    _reference_kernels(monkeypatch, skip_last_row=False)
    real = kernel_bench.lora_linear

    def late_join_for_the_last_row(gemm, x, shrink, expand, schedule):
        base = gemm(x)[-1].clone()
        y = real(gemm, x, shrink, expand, schedule)
        y[-1] = base
        return y

    monkeypatch.setattr(kernel_bench, "lora_linear", late_join_for_the_last_row)
    case = BF16_PREFILL
    slots, lens = case.token_slots()
    plan = plan_segments(slots, lens, block_m=case.block_m)
    with pytest.raises(VerificationError, match="module output differs"):
        kernel_bench._time_module(case, SegmentLayout.from_plan(plan, CPU), plan.token_slots,
                                  CTX)


def _kv_tables_kept_for_the_same_shape(monkeypatch) -> None:
    """Decode graphs' static buffers keep their KV tables (``kv_indices``, ``kv_lens``) when
    the batch has the shape of the last one written: a replay reads the last batch's context."""
    real = DecodeBuffers.write_by_torch

    def write(self, b, n, bucket):
        if n and getattr(self, "_last_shape", None) == (bucket, n):
            for name in ("input_ids", "positions", "out_cache_loc"):
                getattr(self, name)[:n].copy_(getattr(b, name))
            return
        self._last_shape = (bucket, n)
        real(self, b, n, bucket)

    monkeypatch.setattr(DecodeBuffers, "write_by_torch", write)


def test_a_model_case_without_lora_sees_stale_kv_tables(monkeypatch):
    """Only a LoRA runtime replayed a batch of the verified one's shape before verifying: in
    the runtime without LoRA the verified replay was the first of its shape, and read nothing
    stale."""
    _kv_tables_kept_for_the_same_shape(monkeypatch)
    case = model_bench.cases("decode", "tiny", 1, 16, (4,), [(0, ())], "torch",
                             torch.float32)[0]
    [row] = model_bench.run_case(case, CTX, model_bench.RuntimeCache([case], CPU))
    assert row["verification"]["status"] == "failed", row["verification"]
    assert "graph replay differs" in row["verification"]["error"] and row["stats"] is None


def test_an_idle_base_batch_sees_stale_kv_tables(monkeypatch):
    _kv_tables_kept_for_the_same_shape(monkeypatch)
    cases = idle_bench.cases("tiny", 1, "float32", 16, (4,), 2, 8)
    [row] = idle_bench.run_case(cases[1], CTX, idle_bench.RuntimePair(cases, CPU))
    assert row["verification"]["status"] == "failed", row["verification"]
    assert "graph step differs" in row["verification"]["error"] and row["stats"] is None


def _o_proj_dropped_for_one_adapter(monkeypatch, which=lambda names: sorted(names)[1]):
    """Moving one adapter (default: the second by name) into a slot leaves its o_proj term
    out (scaling 0): every path of the runtime serves it so, eager forwards included."""
    real = LoRAManager._write_slot

    def write(self, slot, name):
        real(self, slot, name)
        if name == which(self.adapters):
            for (_, module), w in self.weights.items():
                if module == "o_proj":
                    w.scalings[slot] = 0.0

    monkeypatch.setattr(LoRAManager, "_write_slot", write)


def test_a_throughput_case_serving_an_adapter_without_a_term_is_failed(monkeypatch):
    """The throughput (and DP) reference prefilled the probes through the runtime's own LoRA
    manager, so a LoRA fault of its slots or kernels was in the reference too: the case was
    verified (the model suite's float64 reference failed the same runtime)."""
    _o_proj_dropped_for_one_adapter(monkeypatch)
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    case = throughput_bench.cases("tiny", 1, "float32", 8, 3, 4, [(2, "uniform")], 4)[0]
    row = throughput_bench.run_case(case, CTX)
    v = row["verification"]
    assert v["status"] == "failed" and "float64" in v["error"], v
    assert row["stats"] is None


def test_a_correct_throughput_case_records_its_float64_error(monkeypatch):
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    case = throughput_bench.cases("tiny", 1, "float32", 8, 3, 4, [(2, "uniform")], 4)[0]
    v = throughput_bench.run_case(case, CTX)["verification"]
    assert v["status"] == "verified", v
    assert v["max_rel_err_logits_vs_float64"] < 1e-5


def test_a_model_case_checks_every_adapter_of_a_large_batch(monkeypatch):
    """A batch of more than 8 requests had the first request of 4 adapters checked against
    the float64 model (and 8 rows in all): with 8 adapters over 16 requests, adapter 5's
    requests were never checked, and a fault of that adapter alone was verified."""
    _o_proj_dropped_for_one_adapter(monkeypatch, lambda names: "bench5")
    case = model_bench.cases("decode", "tiny", 1, 8, (16,), [(8, (4,))], "torch",
                             torch.float32)[0]
    [row] = model_bench.run_case(case, CTX, model_bench.RuntimeCache([case], CPU))
    v = row["verification"]
    assert v["status"] == "failed" and "requests {5:" in v["error"], v
