"""The idle, DP, attention and throughput suites of ``python -m bench``: verified rows carry
the fields the report draws; a case failing verification is failed and not timed; a DP size
the machine cannot run is skipped with the reason, a failed spawn fails its cases; a LoRA
throughput case interleaves its timed passes with a base runtime's."""

from __future__ import annotations

import re
import statistics

import pytest
import torch

from bench import attention_bench, attention_suite, dp_suite, idle_bench, throughput_bench
from bench.attention_bench import AttentionCase
from bench.context import Context
from bench.hardware import Ceilings
from bench.model_runtime import BenchRuntime
from bench.scenarios import IdleCase
from kernels.config import interpreted

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=2, profile="cpu")
IDLE = IdleCase("tiny", 1, "float32", "idle_forward", 0, 0, 2, 4)
BASE = IdleCase("tiny", 1, "float32", "base_batch", 1, 8, 2, 4)
VARIANTS = {(rt, p) for rt in idle_bench.RUNTIMES for p in idle_bench.PATHS}


@pytest.fixture(scope="module")
def pair():
    return idle_bench.RuntimePair([IDLE, BASE], CPU)


def test_idle_rows_are_verified_and_carry_the_report_fields(pair):
    rows = idle_bench.run_case(IDLE, CTX, pair) + idle_bench.run_case(BASE, CTX, pair)
    for case in (IDLE, BASE):
        mine = [r for r in rows if r["label"] == case.label]
        assert {(r["runtime"], r["path"]) for r in mine} == VARIANTS
        for r in mine:
            assert r["verification"]["status"] == "verified", r["verification"]
            assert r["scenario"] == case.scenario and r["batch_size"] == case.batch_size
            reps = CTX.reps * (idle_bench.EAGER_REPS if r["path"] == "eager" else 1)
            assert r["stats"]["n"] == len(r["samples_us"]) == reps
            d = r["derived"]
            assert (d["overhead_pct"] is None) == (r["runtime"] == "no_lora")
            assert d["graph_kind"] == (None if r["path"] == "eager" else "base")
            reads_weights = case is BASE or r["path"] == "graph"
            assert ("x_floor" in d) == reads_weights
        # eager: the two runtimes alternate, each rep judged against its partner
        eager = {r["runtime"]: r for r in mine if r["path"] == "eager"}
        pairs = zip(eager["lora"]["samples_us"], eager["no_lora"]["samples_us"], strict=True)
        want = 100 * (statistics.median(a / b for a, b in pairs) - 1)
        assert eager["lora"]["derived"]["overhead_pct"] == pytest.approx(want)
    charts = pytest.importorskip("bench.report_charts")
    [fig] = charts.idle(rows)
    assert len(fig.data) == len(VARIANTS)
    assert "verified" in idle_bench.table(rows)


def _plus_one_in_lora_runtime(method):
    orig = getattr(BenchRuntime, method)
    return lambda self, *a: orig(self, *a) + (1.0 if self.lora is not None else 0.0)


def _writes_kv(self):
    out = self.graphs.replay(self.runner.idle_batch())
    self.kv.k[0][1] += 1.0  # a padding row's K landing in a live slot
    return out


def _lora_variant(self):
    return self.graphs.replay(self.runner.idle_batch(), None,
                              "lora" if self.lora is not None else None)


@pytest.mark.parametrize("case, faults, message", [
    (BASE, {"step": _plus_one_in_lora_runtime("step")}, "graph step differs from its eager"),
    (BASE, {"step": _plus_one_in_lora_runtime("step"),
            "eager": _plus_one_in_lora_runtime("eager")}, "differs from the runtime without"),
    (IDLE, {"idle_step": _writes_kv}, "wrote KV slots other than the scratch slot"),
    (IDLE, {"idle_step": _lora_variant}, "LoRA batch prepared|replayed the lora graph"),
], ids=["replay differs", "lora changes base traffic", "idle writes KV", "idle replays lora"])
def test_an_idle_case_failing_verification_is_failed_and_not_timed(pair, monkeypatch, case,
                                                                   faults, message):
    for name, fault in faults.items():
        monkeypatch.setattr(BenchRuntime, name, fault)
    [row] = idle_bench.run_case(case, CTX, pair)
    assert row["verification"]["status"] == "failed"
    assert re.search(message, row["verification"]["error"])
    assert row["stats"] is None and row["samples_us"] == []


def test_a_dp_size_above_the_gpus_present_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = Context(torch.device("cuda"), CTX.ceilings, reps=2, profile="gpu")
    cases = dp_suite.cases("llama3-8b", 4, "bfloat16", (2,), ("skewed",), (0, 4), 16)
    run = dp_suite.make_runner(cases, gpu)
    for case in cases:
        [row] = run(case)
        assert row["verification"]["status"] == "skipped" and row["stats"] is None
        assert "needs 2 GPUs" in row["verification"]["error"]


def test_a_failed_dp_spawn_fails_its_cases(monkeypatch):
    def dead_rank(*a, **k):
        raise RuntimeError("rank 1 exited with code 3")

    monkeypatch.setattr(dp_suite, "spawn", dead_rank)
    cases = dp_suite.cases("tiny", 1, "float32", (2,), ("skewed",), (0, 2), 8)
    run = dp_suite.make_runner(cases, CTX)
    rows = [r for c in cases for r in run(c)]
    assert [r["verification"]["status"] for r in rows] == ["failed", "failed"]
    assert all("rank 1 exited" in r["verification"]["error"] for r in rows)


ATTENTION = AttentionCase("decode", 2, 16, 0, "triton", 2, 1, 16, dtype="float32")
needs_interpreter = pytest.mark.skipif(
    not interpreted(), reason="the Triton provider on CPU tensors needs TRITON_INTERPRET=1 (a "
    "GPU machine compiles Triton for its GPU)")


@needs_interpreter
def test_an_attention_case_is_verified_then_timed():
    [row] = attention_suite.run_case(ATTENTION, CTX)
    assert row["verification"]["status"] == "verified"
    assert row["stats"]["n"] == CTX.reps and row["derived"]["x_floor"] > 0
    assert row["regime"] == "decode" and row["dtype"] == "float32"


@needs_interpreter
def test_an_attention_case_off_the_reference_is_failed_and_not_timed(monkeypatch):
    monkeypatch.setattr(attention_bench, "_request_error", lambda *a: 0.5)
    [row] = attention_suite.run_case(ATTENTION, CTX)
    assert row["verification"]["status"] == "failed" and "relative error" in \
        row["verification"]["error"]
    assert row["stats"] is None


THROUGHPUT = throughput_bench.cases("tiny", 1, "float32", 8, 3, 4, [(2, "uniform")], 4)[0]


def _record_passes(monkeypatch, corrupt_base: bool = False) -> list[str]:
    order, real = [], throughput_bench._Runtime.timed_pass

    def timed_pass(self, workload):
        real(self, workload)
        order.append("lora" if self.runner.lora is not None else "base")
        if corrupt_base and self.runner.lora is None:
            self.passes[-1][0] = self.passes[-1][0][:-1]  # a request one token short

    monkeypatch.setattr(throughput_bench._Runtime, "timed_pass", timed_pass)
    return order


def test_a_lora_throughput_case_interleaves_a_base_runtime(monkeypatch):
    order = _record_passes(monkeypatch)
    row = throughput_bench.run_case(THROUGHPUT, CTX)
    assert order == ["base", "lora"] * throughput_bench.TIMED_PASSES
    d = row["derived"]
    assert row["verification"]["status"] == "verified", row["verification"]
    # each LoRA pass against the base pass just before it, the median of the pairs
    walls = [s * 1e-6 for s in row["samples_us"]]
    assert len(d["pct_of_base_pairs"]) == throughput_bench.TIMED_PASSES
    assert d["pct_of_base"] == pytest.approx(statistics.median(d["pct_of_base_pairs"]))
    assert min(d["pct_of_base_pairs"]) <= d["pct_of_base"] <= max(d["pct_of_base_pairs"])
    assert d["output_tokens_per_s"] == pytest.approx(d["output_tokens"] / statistics.median(
        walls))
    assert d["output_tokens"] == 4 * 3 and row["stats"]["n"] == throughput_bench.TIMED_PASSES
    # Where the pass went, for the case and its base: decode and extend steps, each within
    # the pass's wall time, every step of the median pass counted once.
    walls = {"": d["duration_s"], "base_": d["output_tokens"] / d["base_output_tokens_per_s"]}
    for prefix, wall in walls.items():
        steps = d[f"{prefix}decode_ms_total"] + d[f"{prefix}extend_ms_total"]
        assert d[f"{prefix}decode_ms_total"] > 0 and d[f"{prefix}extend_ms_total"] > 0
        assert d[f"{prefix}extend_step_ms_p50"] <= d[f"{prefix}extend_ms_total"]
        assert steps <= 1e3 * wall
    # LoRA's bytes floor: the median base pass plus the floor of the median LoRA pass
    assert d["lora_floor_ms"] > 0
    base_wall = walls["base_"]
    assert d["pct_of_base_at_floor"] == pytest.approx(
        100 * base_wall / (base_wall + d["lora_floor_ms"] / 1e3))
    assert "ms a pass over base" in throughput_bench.table([row])


def test_a_throughput_case_with_more_adapters_than_slots_counts_its_slot_writes(monkeypatch):
    """One slot, two adapters: every pass moves adapters in and out of the slot, and the timed
    passes still repeat the untimed pass's tokens (a stale slot would change them)."""
    monkeypatch.setattr(throughput_bench, "SLOTS", 1)
    row = throughput_bench.run_case(THROUGHPUT, CTX)
    d = row["derived"]
    assert row["verification"]["status"] == "verified", row["verification"]
    assert d["slot_writes"] >= 2 and d["slot_write_ms"] > 0


def test_a_throughput_case_whose_base_runtime_falls_short_is_failed(monkeypatch):
    _record_passes(monkeypatch, corrupt_base=True)
    row = throughput_bench.run_case(THROUGHPUT, CTX)
    assert row["verification"]["status"] == "failed"
    assert "interleaved base runtime" in row["verification"]["error"]
