"""The benchmark tools against what a twelfth hunt found: the DP chart's idle-forward lines
merged the LoRA cases of several adapter counts into one line; a base-step, model or idle case
that raised while holding KV slots left them taken, so later cases of the model failed with
"KV cache full"; ``route_ab`` read ``1e9`` as an int alone but not inside a tuple, and refused
such a tuple saying it had the wrong number of values; ``dp_bench --timeout`` was ignored under
torchrun; a model or idle case failing now was left out of the change against a baseline;
repeated ``--filter``s each valid alone were refused together when one had global flags."""

from __future__ import annotations

import pytest
import torch

from bench import base_step_suite, route_ab
from bench.context import Context
from bench.hardware import Ceilings
from bench.results import make_row
from bench.scenarios import DPCase

OK = {"status": "verified", "error": None}


def test_the_idle_forward_chart_draws_each_adapter_count_apart():
    """``dp_bench --adapters 0 4 16``: both LoRA cases' idle forwards went to one line per
    variant and load, two points at every DP size."""
    pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
    from bench import report_charts

    rows = [make_row(DPCase("llama3-8b", 4, "bfloat16", size, "balanced", a, "16"), "gpu", {},
                     verification=OK, derived={"output_tokens_per_s": 100.0 * a,
                                               "idle_forward_lora_us": 10.0 * a})
            for a in (4, 16) for size in (1, 2)]
    [_, idle_us] = report_charts.dp(rows)
    lines = {t.name: (list(t.x), list(t.y)) for t in idle_us.data}
    assert len(lines) == 2, lines
    assert sorted(lines.values()) == [([1, 2], [40.0, 40.0]), ([1, 2], [160.0, 160.0])]
    assert all("adapters=" in name for name in lines)


CTX = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=2, profile="cpu")


def test_a_base_step_case_that_raises_after_taking_its_slots_gives_them_back(monkeypatch):
    """The run goes on after a case that raises (one failed row): the timed batch's KV slots,
    freed only after timing, stayed taken, and the next case of the model failed with "KV
    cache full" instead of running."""
    [case] = base_step_suite.cases("tiny", 1, "float32", (3,), (16,), ("torch",))
    run = base_step_suite.make_runner([case], CTX)
    real, calls = base_step_suite.bench_time, []

    def fails_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*a, **k)

    monkeypatch.setattr(base_step_suite, "bench_time", fails_once)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(case)
    [row] = run(case)
    assert row["verification"]["status"] == "verified", row["verification"]


def test_route_ab_reads_1e9_as_an_int_inside_a_tuple_too():
    """``FORK_MAX_ROWS=1e9`` was an int, ``CAPTURE_GEMM_LT_ROWS=(33, 1e9)`` refused as "it
    takes 2 values" though it held 2."""
    v = route_ab.parse_variant("a:CAPTURE_GEMM_LT_ROWS=(33, 1e9)")
    assert v.knobs == (("CAPTURE_GEMM_LT_ROWS", None, (33, 10**9)),)


def test_route_ab_names_the_element_type_a_tuple_knob_takes():
    with pytest.raises(ValueError, match=r"WIDE_BLOCK=\(64, 64, 'x'\): it takes 3 values of "
                                         r"type int, int, int like its default"):
        route_ab.parse_variant("a:WIDE_BLOCK=(64, 64, 'x')")
    with pytest.raises(ValueError, match=r"WIDE_BLOCK=\(64, 64\): it takes 3 "):
        route_ab.parse_variant("a:WIDE_BLOCK=(64, 64)")


def _fails_building(traffic: str):
    """``BenchRuntime.batch`` raising for ``traffic``'s prefilled batch (an eager prefill that
    raises), the other traffic's batch built before it."""
    from bench.model_runtime import BenchRuntime

    real = BenchRuntime.batch

    def batch(self, batch_size, t, seed=None, shift=0, prefilled=True):
        if t == traffic and prefilled and self.names:
            raise RuntimeError("the eager prefill raised")
        return real(self, batch_size, t, seed, shift, prefilled)

    return batch


def test_a_model_case_whose_lora_batch_raises_gives_back_the_base_batch_s_slots(monkeypatch):
    """The base traffic's batch was built, then the LoRA one raised: its slots stayed taken in
    the runtime the next cases share (a cache of room for two batches: the next case of the
    largest size failed with "KV cache full")."""
    from bench.model_bench import ModelCase, RuntimeCache, run_case
    from bench.model_runtime import BenchRuntime

    case = ModelCase("decode", "tiny", 1, 16, 2, 2, (8,), "torch", torch.float32)
    cache = RuntimeCache([case], torch.device("cpu"))
    free = cache.get(case).kv.free_slots
    monkeypatch.setattr(BenchRuntime, "batch", _fails_building("lora"))
    with pytest.raises(RuntimeError, match="the eager prefill raised"):
        run_case(case, CTX, cache)
    assert cache.get(case).kv.free_slots == free


def test_an_idle_case_whose_lora_runtime_batch_raises_gives_back_the_other_s(monkeypatch):
    from bench import idle_bench
    from bench.model_runtime import BenchRuntime

    cases = idle_bench.cases("tiny", 1, "float32", 16, (2,), 2, 8)
    pairs = idle_bench.RuntimePair(cases, torch.device("cpu"))
    free = {n: rt.kv.free_slots for n, rt in pairs.get(cases[1]).items()}
    monkeypatch.setattr(BenchRuntime, "batch", _fails_building("base"))
    with pytest.raises(RuntimeError, match="the eager prefill raised"):
        idle_bench.run_case(cases[1], CTX, pairs)
    assert {n: rt.kv.free_slots for n, rt in pairs.get(cases[1]).items()} == free


def test_dp_bench_under_torchrun_bounds_its_collectives_by_timeout(monkeypatch, tmp_path):
    """``torchrun ... -m bench.dp_bench --timeout 300``: the ranks joined with the library's
    60 s, whatever ``--timeout`` said (spawned ranks got it through the environment)."""
    from bench import dp_bench

    seen = []

    class Stop(Exception):
        pass

    def init_dp(device, timeout_s=None):
        seen.append(timeout_s)
        raise Stop

    monkeypatch.setattr(dp_bench, "init_dp", init_dp)
    monkeypatch.delenv("DP_TIMEOUT_S", raising=False)
    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Stop):
        dp_bench.main(["--preset", "tiny", "--layers", "1", "--timeout", "300", "--out",
                       str(tmp_path / "dp.json")])
    assert seen == [300.0]


def test_a_model_or_idle_case_failing_now_is_counted_against_the_baseline():
    """A failed model or idle case is one row of variant ``all``, matching no baseline row:
    its rows timed in the baseline were left out of the comparison without a word, where a
    failing kernel, DP or throughput case showed FAILS NOW."""
    pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
    from report_rows import RUN, rows

    from bench import report
    from bench.results import case_id

    runs = {RUN["run_id"]: RUN}
    then = report.with_device(rows(), runs)
    model = next(r for r in then if r["suite"] == "model" and r["stats"] and r["adapters"])
    idle = next(r for r in then if r["suite"] == "idle")
    gone = {case_id(model), case_id(idle)}
    now = [r for r in then if case_id(r) not in gone] + [
        r | {"stats": None, "samples_us": [], "derived": {}, **dict.fromkeys(r["variant"], "all"),
             "verification": {"status": "failed", "error": "replay differs"}}
        for r in (model, idle)]
    text, _ = report.deltas(now, then)
    lost = [r for r in then if case_id(r) in gone]
    assert len(lost) == 6 + 4
    assert text.count("FAILS NOW") == len(lost)
    assert f"<b>{len(lost)}</b> rows timed in the baseline fail now" in text


def test_repeated_filters_each_with_its_own_flags_select_the_cases_matching_any():
    """Each ``--filter`` was checked alone and then joined into one regex: a filter valid
    alone, ``(?i)KERNELS qkv``, was refused beside another as "not a valid regex", naming a
    regex nobody gave (global flags not at the start)."""
    from bench import case as case_mod
    from bench import cli

    args = cli.parse_args(["--profile", "cpu", "--filter", "(?i)KERNELS QKV",
                           "--filter", "^idle ", "--filter", "(?x) ^base_step \\s tiny # x"])
    chosen = cli.select(args, "cpu")
    assert set(chosen) == {"kernels", "idle", "base_step"}, sorted(chosen)
    assert {c.module for c in chosen["kernels"]} == {"qkv_proj"}
    assert case_mod.select(chosen["idle"], args.filter) == chosen["idle"]
