"""The ``python -m bench.<tool>`` entry points refuse bad arguments up front with a one-line
usage error naming the flag (argparse's exit status 2), before any rank, runtime, kernel or
benchmark starts: a spawned rank's traceback, a result file that cannot be written after the
whole run, or a silent run of nothing were what these inputs gave."""

from __future__ import annotations

import json

import mutants
import pytest
import torch
from cli_checks import never, usage_error

from bench import attention_bench, base_step_bench, dp_bench, route_ab, serve_phases, sweep
from bench.host import __main__ as host_main
from bench.host import compare

DP = ["--preset", "tiny", "--layers", "1", "--requests-per-rank", "1", "--prompt", "4",
      "--output", "2", "--max-batch", "2"]


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "0"], "argument --sizes: must be >= 1, got 0"),
    (["--preset", "bogus"], "argument --preset: invalid choice: 'bogus'"),
    (["--max-batch", "0"], "--max-batch"),
    (["--adapters", "-1"], "argument --adapters: must be >= 0, got -1"),
    (["--prompt", "x"], "argument --prompt: 'x' is not an integer"),
    (["--requests-per-rank", "0"], "--requests-per-rank"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "inf"], "--timeout: timeout_s must be a number of seconds from 0.001"),
    (["--timeout", "1e-9"], "--timeout: timeout_s must be a number of seconds from 0.001"),
])
def test_dp_bench_refuses_bad_sizes_before_spawning(monkeypatch, capsys, tmp_path, argv, says):
    monkeypatch.setattr(dp_bench, "spawn", never)
    usage_error(capsys, dp_bench.main, DP + argv + ["--out", str(tmp_path / "dp.json")], says)


def test_dp_bench_refuses_an_out_it_could_not_write_before_spawning(monkeypatch, capsys,
                                                                    tmp_path):
    monkeypatch.setattr(dp_bench, "spawn", never)
    usage_error(capsys, dp_bench.main, DP + ["--out", str(tmp_path / "no" / "dp.json")],
                 "does not exist")
    usage_error(capsys, dp_bench.main, DP + ["--out", str(tmp_path)], "is a folder")


@pytest.mark.parametrize("argv, says", [
    (["--rounds", "0"], "--rounds"),
    (["--reps", "0"], "--reps"),
    (["--bs", "8,0"], "argument --bs: must be >= 1, got 0"),
    (["--dtype", "foo"], "not a torch dtype"),
    # a torch dtype, but no model is built in it: a TypeError traceback from nn.Module.to
    (["--dtype", "int32"], "argument --dtype: 'int32' is not a floating-point dtype"),
    (["--dtype", "float8_e4m3fn"], "'float8_e4m3fn' is not a floating-point dtype"),
    (["--preset", "bogus"], "argument --preset: invalid choice"),
    (["--backend", "bogus"], "argument --backend: invalid choice"),
    (["--device", "foo"], "argument --device: 'foo' is not a torch device"),
])
def test_route_ab_refuses_bad_values_at_parse(capsys, argv, says):
    usage_error(capsys, route_ab.parse_args,
                 ["--preset", "tiny", "--variant", "a", "--variant", "b", *argv], says)


@pytest.mark.parametrize("argv, says", [
    (["--popularity", "identical"], "uses one adapter"),
    (["--popularity", "distinct", "--adapters", "3"], "(give "),
    (["--device", "foo"], "argument --device: 'foo' is not a torch device"),
])
def test_serve_phases_refuses_a_workload_it_cannot_build(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(serve_phases, "run", never)
    usage_error(capsys, serve_phases.main, argv, says)


def test_hostbench_refuses_a_missing_baseline_before_running(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(host_main, "run_benchmarks", never)
    usage_error(capsys, host_main.main, ["--out", str(tmp_path), "--baseline",
                                          str(tmp_path / "nope.json")],
                 "argument --baseline: ")
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        host_main.main(["--out", str(file)])


def test_hostbench_refuses_a_baseline_that_is_not_a_host_run_before_running(monkeypatch, capsys,
                                                                          tmp_path):
    """A suite's result file compared as a run of no benchmarks: "nothing compared", exit 0,
    and --publish replaced the reference; a truncated one was a traceback after the run."""
    monkeypatch.setattr(host_main, "run_benchmarks", never)
    suite = tmp_path / "kernels-cpu.json"
    suite.write_text(json.dumps({"schema": 2, "runs": {}, "rows": []}))
    cut = tmp_path / "host-cpu.json"
    cut.write_text('{"benchmarks": [{"name"')
    for path, says in ((suite, "not a host-path benchmark run"), (cut, "not valid JSON")):
        usage_error(capsys, host_main.main, ["--out", str(tmp_path), "--publish",
                                              "--baseline", str(path)],
                     f"argument --baseline: {path}: {says}")
        new = tmp_path / "20250102-120000-cpu.json"
        new.write_text(json.dumps({"benchmarks": []}))
        usage_error(capsys, compare.main, [str(new), str(path)], f"{path}: {says}")


def test_hostbench_refuses_to_publish_another_set_up_before_running(monkeypatch, tmp_path):
    # The reference holds the default set-up's every benchmark: --host-batch-sizes 1,8 (or
    # --host-devices cpu on a GPU host) replaced it with a subset of its rows.
    monkeypatch.setattr(host_main, "run_benchmarks", never)
    for opt in (["--host-batch-sizes", "1,8"], ["--host-devices=cpu"]):
        with pytest.raises(SystemExit, match="--publish with --host-"):
            host_main.main(["--out", str(tmp_path), "--publish", *opt])


def test_compare_names_a_missing_run_file(capsys, tmp_path):
    new = tmp_path / "20250102-120000-cpu.json"
    new.write_text(json.dumps({"benchmarks": []}))
    usage_error(capsys, compare.main, [str(new), str(tmp_path / "old.json")],
                 "old.json: no such file")
    usage_error(capsys, compare.main, [str(tmp_path / "20250103-120000-cpu.json")],
                 "no such file")


def test_mutants_refuse_an_unknown_only_before_the_baseline(monkeypatch, capsys):
    monkeypatch.setattr(mutants, "_run", never)
    usage_error(capsys, mutants.main, ["--only", "no_such_mutant"], "no_such_mutant")


SWEEP = ["--preset", "tiny", "--module", "gate_up_proj", "--tokens", "4", "--rank", "8",
         "--kernel", "expand", "--once"]


@pytest.mark.parametrize("argv, says", [
    (["--grid", "block_n"], "name=v1,v2"),
    (["--grid", "foo=1"], "not a launch override"),
    (["--grid", "block_n=x"], "integers or auto"),
    (["--tokens", "0"], "--tokens"),
    (["--module", "nope"], "unknown module"),
])
def test_sweep_refuses_a_bad_grid_before_launching(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(sweep.kernel_bench, "make_weights", never)
    usage_error(capsys, sweep.main, SWEEP + argv, says)


def test_attention_bench_refuses_zero_reps_and_an_unwritable_json(monkeypatch, capsys,
                                                                  tmp_path):
    monkeypatch.setattr(attention_bench, "run_attention_suite", never)
    usage_error(capsys, attention_bench.main, ["--quick", "--reps", "0"], "--reps")
    usage_error(capsys, attention_bench.main,
                 ["--quick", "--json", str(tmp_path / "no" / "rows.json")], "--json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_base_step_bench_says_profile_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(base_step_bench, "run_base_step", never)
    usage_error(capsys, base_step_bench.main, ["--profile", "256", "512"], "needs a GPU")


def test_base_step_bench_refuses_a_profile_pair_it_does_not_replay(monkeypatch, capsys):
    monkeypatch.setattr(base_step_bench, "run_base_step", never)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    usage_error(capsys, base_step_bench.main, ["--profile", "32", "512"], "--profile 32 512")
    usage_error(capsys, base_step_bench.main, ["--contexts", "1024", "--profile", "256", "512"],
                 "--profile 256 512")
    ran = []
    monkeypatch.setattr(base_step_bench, "run_base_step",
                        lambda device, *a, **k: ran.append((device.type, k.get("profile"))) or [])
    base_step_bench.main(["--profile", "256", "512"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base_step_bench.main([])
    assert ran == [("cuda", [(256, 512)]), ("cpu", None)]


def test_dp_bench_under_torchrun_refuses_sizes_other_than_the_world(monkeypatch, capsys,
                                                                    tmp_path):
    monkeypatch.setattr(dp_bench, "run_rank", never)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    usage_error(capsys, dp_bench.main, DP + ["--sizes", "1", "4", "--out",
                                              str(tmp_path / "dp.json")],
                 "under torchrun the DP size is the world size (2)")
