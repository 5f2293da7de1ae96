"""``bench.route_ab``: variants parsed with errors that name the knob, knobs applied for a
variant's capture and restored after, and an A/B end to end on the CPU stand-in graphs."""

from __future__ import annotations

import pytest
import torch

import kernels.config as config
import lora_runtime.lora.side_stream as side_stream
from bench import route_ab


def test_variants_parse_and_bad_ones_name_the_fix():
    v = route_ab.parse_variant("old:WIDE_BLOCKS_MIN_ROWS=1e9,GRAPH_WINDOWS_MIN_ROWS.rope=64,"
                               "SIDE_STREAM=False,WIDE_BLOCK=(64, 64, 4)")
    assert v.name == "old"
    assert v.knobs == (("WIDE_BLOCKS_MIN_ROWS", None, 10**9),
                       ("GRAPH_WINDOWS_MIN_ROWS", "rope", 64), ("SIDE_STREAM", None, False),
                       ("WIDE_BLOCK", None, (64, 64, 4)))
    assert route_ab.parse_variant("plain").knobs == ()
    for spec, says in [("x:NO_SUCH_KNOB=1", "unknown knob 'NO_SUCH_KNOB'"),
                       ("x:GRAPH_WINDOWS_MIN_ROWS=1", "is a dict; set one key"),
                       ("x:GRAPH_WINDOWS_MIN_ROWS.silu_mul=1", "has no key 'silu_mul'"),
                       ("x:WIDE_BLOCKS_MIN_ROWS", "is not KNOB=VALUE"),
                       ("x:WIDE_BLOCKS_MIN_ROWS=lots", "is not a Python literal"),
                       (":WIDE_BLOCKS_MIN_ROWS=1", "give it a name"),
                       # a knob without a name ran the defaults under the name "KNOB=1"
                       ("WIDE_BLOCKS_MIN_ROWS=1", "a name has no '='"),
                       # the last setting won, the row listing both
                       ("x:FORK_MAX_ROWS=1,FORK_MAX_ROWS=2", "FORK_MAX_ROWS is set twice"),
                       ("x:GRAPH_WINDOWS_MIN_ROWS.rope=1,GRAPH_WINDOWS_MIN_ROWS.rope=2",
                        "rope is set twice"),
                       # values of the right type that the kernels cannot compile (ptxas
                       # failed on the GPU), refused as their environment variables are
                       ("x:ROPE_WIDE_WINDOW=24", "give a power of two >= 16 and at most 128"),
                       ("x:ROPE_WIDE_WINDOW=256", "at most 128"),
                       ("x:WIDE_MAXNREG=300", "register count from 32 to 255"),
                       ("x:ROW_SHRINK_ELEMENTS=12288", "give a power of two >= 16")]:
        with pytest.raises(ValueError, match=says):
            route_ab.parse_variant(spec)
    with pytest.raises(SystemExit):
        route_ab.parse_args(["--variant", "a", "--variant", "a"])


def test_a_batch_size_given_twice_is_refused(capsys):
    """``--bs 1,1`` printed two identical rows, each with twice --rounds rounds."""
    with pytest.raises(SystemExit) as e:
        route_ab.parse_args(["--preset", "tiny", "--bs", "1,8,1", "--variant", "a"])
    assert e.value.code == 2 and "--bs 1,8,1: batch size 1 is given twice" in (
        capsys.readouterr().err)
    assert route_ab.parse_args(["--preset", "tiny", "--bs", "8,1", "--variant", "a"]).bs == [8, 1]


def test_a_variants_knobs_hold_inside_and_are_restored_after():
    before = (config.WIDE_BLOCKS_MIN_ROWS, dict(config.GRAPH_WINDOWS_MIN_ROWS),
              side_stream.ENABLED)
    v = route_ab.parse_variant("v:WIDE_BLOCKS_MIN_ROWS=7,GRAPH_WINDOWS_MIN_ROWS.rope=3,"
                               "SIDE_STREAM=0")
    with route_ab.knobs_of(v):
        assert config.WIDE_BLOCKS_MIN_ROWS == 7 and config.GRAPH_WINDOWS_MIN_ROWS["rope"] == 3
        assert side_stream.ENABLED is False
    assert before == (config.WIDE_BLOCKS_MIN_ROWS, config.GRAPH_WINDOWS_MIN_ROWS,
            side_stream.ENABLED)


def test_an_ab_run_captures_each_variant_under_its_knobs(monkeypatch):
    """Two variants on the CPU stand-in graphs: gate_up's term added by rows in SwiGLU, or
    never there (the separate expand). The route choice, recorded while each runtime captured
    and verified, saw each variant's limit; every row is timed, verified against eager, and
    the knob is back."""
    seen, real = [], config.row_epilogue

    def spy(rows, consumer, num_slots=0):
        if consumer == "silu_mul":
            seen.append(config.ROW_EPILOGUE_MAX_ROWS["silu_mul"])
        return real(rows, consumer, num_slots)

    monkeypatch.setattr(config, "row_epilogue", spy)
    default = dict(config.ROW_EPILOGUE_MAX_ROWS)
    args = route_ab.parse_args([
        "--step", "prefill", "--preset", "tiny", "--layers", "1", "--context", "8",
        "--adapters", "2", "--rank", "8", "--bs", "2", "--rounds", "2", "--reps", "1",
        "--variant", "rows:ROW_EPILOGUE_MAX_ROWS.silu_mul=63",
        "--variant", "expand:ROW_EPILOGUE_MAX_ROWS.silu_mul=-1"])
    rows = route_ab.run(args)
    assert {63, -1} <= set(seen)
    assert default == config.ROW_EPILOGUE_MAX_ROWS
    assert [r["variant"] for r in rows] == ["rows", "expand"]
    for r in rows:
        assert r["lora_us"] > 0 and r["base_us"] > 0 and len(r["added_us_rounds"]) == 2
        assert r["max_rel_err_vs_eager"] < 1e-3
    assert "adds % of base" in route_ab.table(rows)


def test_a_cpu_run_says_its_times_mean_nothing_off_stdout(monkeypatch, capsys):
    monkeypatch.setattr(route_ab, "run", lambda args: [])
    assert route_ab.main(["--device", "cpu", "--json", "--variant", "a"]) == 0
    out, err = capsys.readouterr()
    assert "mean nothing as performance figures" in err and out.strip() == ""


def test_a_variant_that_does_not_fit_names_the_fix(monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.54 GiB")

    monkeypatch.setattr(route_ab, "BenchRuntime", oom)
    args = route_ab.parse_args(["--preset", "tiny", "--layers", "32", "--bs", "64,256",
                                "--variant", "a", "--variant", "b", "--device", "cpu"])
    with pytest.raises(SystemExit, match=r"variant 'a' .*32 layers.*320 requests.*fewer "
                                         r"variants, fewer --layers or smaller --bs"):
        route_ab.run(args)


def test_kernel_diff_orders_names_by_the_change():
    from bench.kernel_diff import kernel_diff

    lora = {"shrink": [5.0, 4.0], "gemm": [100.0, 4.0], "silu_lora": [9.0, 1.0]}
    base = {"gemm": [99.0, 4.0], "silu": [4.0, 1.0]}
    got = kernel_diff(lora, base, 3)
    assert [d["name"] for d in got] == ["silu_lora", "shrink", "silu"]
    assert got[0] == {"name": "silu_lora", "diff_us": 9.0, "a_us": 9.0, "b_us": 0,
                      "a_launches": 1.0, "b_launches": 0}
    assert got[2]["diff_us"] == -4.0


def test_an_ab_run_lists_what_lora_adds_kernel_by_kernel():
    """``--kernels N``: each row names the N kernels (CPU: ops) whose time LoRA changes most,
    LoRA's own launches among them (none of them in the base replay)."""
    args = route_ab.parse_args([
        "--step", "decode", "--preset", "tiny", "--layers", "1", "--context", "8",
        "--adapters", "2", "--rank", "8", "--bs", "2", "--rounds", "1", "--reps", "1",
        "--kernels", "6", "--variant", "today"])
    [row] = route_ab.run(args)
    diff = row["kernel_diff"]
    assert 0 < len(diff) <= 6 and all(isinstance(d["name"], str) for d in diff)
    assert any(d["a_launches"] > 0 and d["b_launches"] == 0 for d in diff), diff
    assert "LoRA replay minus base replay by kernel" in route_ab.table([row])
    with pytest.raises(SystemExit):
        route_ab.parse_args(["--kernels", "-1", "--variant", "a"])
