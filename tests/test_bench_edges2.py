"""More inputs of the benchmark tools that went wrong: a ``--baseline`` holding no result rows
("the baseline's devices (none) are not this run's"), a ``--screenshot`` path that is a folder,
under a file, or the report itself (a traceback, or the report deleted), a ``route_ab`` knob
value of the wrong type (a TypeError from inside the runtime after every variant was built),
a ``sweep`` grid naming one override twice (the first list silently dropped) or a block size
its kernel cannot launch, the ``command`` a run records when ``python -m bench`` runs inside
another tool, and ``--list`` of a GPU profile on a machine without one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from report_rows import RUN, rows

from bench import cli, route_ab, sweep


def _never(*args, **kwargs):
    raise AssertionError("the tool started its work before refusing its arguments")


def _result(path: Path, data_rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": 2, "runs": {RUN["run_id"]: RUN}, "rows": data_rows}))
    return path


def test_a_baseline_without_result_rows_is_an_error_naming_it(tmp_path):
    report = pytest.importorskip("bench.report")
    k = _result(tmp_path / "k.json", rows()[:4])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "trace.json").write_text('{"traceEvents": []}')
    out = tmp_path / "r.html"
    with pytest.raises(SystemExit, match=f"--baseline {empty}: no result rows"):
        report.main([str(k), "--baseline", str(empty), "-o", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("shot, says", [
    ("folder", "is a folder"),
    ("afile/x.png", "cannot create"),
    ("r.html", "give a .png path"),
    ("k.json", "give a .png path"),
])
def test_a_screenshot_path_it_cannot_use_is_refused_before_the_report(tmp_path, monkeypatch,
                                                                      shot, says):
    report = pytest.importorskip("bench.report")
    monkeypatch.setattr(report, "write_report", _never)
    k = _result(tmp_path / "k.json", rows()[:4])
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    before = k.read_text()
    with pytest.raises(SystemExit, match=f"--screenshot {tmp_path / shot}.*{says}"):
        report.main([str(k), "-o", str(tmp_path / "r.html"), "--screenshot",
                     str(tmp_path / shot)])
    assert k.read_text() == before


@pytest.mark.parametrize("spec, says", [
    ("a:ONE_LAUNCH_MAX_ROWS='x'", "ONE_LAUNCH_MAX_ROWS='x' is of type str; it takes type int"),
    ("a:WIDE_BLOCKS_MIN_ROWS=(1, 2)",
     "WIDE_BLOCKS_MIN_ROWS=(1, 2) is of type tuple; it takes type int"),
    ("a:ROW_EPILOGUE_MAX_ROWS.rope=1.5", "ROW_EPILOGUE_MAX_ROWS.rope=1.5 is of type float"),
    ("a:WIDE_BLOCK=(64, 64)", "WIDE_BLOCK=(64, 64): it takes 3 values"),
    ("a:PDL=None", "PDL=None is of type NoneType; it takes type bool"),
    ("a:SIDE_STREAM=2", "SIDE_STREAM=2 is of type int; it takes type bool"),
])
def test_route_ab_refuses_a_knob_value_of_the_wrong_type(capsys, spec, says):
    with pytest.raises(ValueError, match=f"variant 'a': {re.escape(says)}"):
        route_ab.parse_variant(spec)
    with pytest.raises(SystemExit) as e:
        route_ab.parse_args(["--preset", "tiny", "--variant", spec])
    assert e.value.code == 2 and "argument --variant" in capsys.readouterr().err
    ok = route_ab.parse_variant("a:SIDE_STREAM=0,PDL=False,WIDE_BLOCK=(64, 64, 4),"
                                "ROW_EPILOGUE_MAX_ROWS.rope=-1,FORK_MAX_ROWS=1e9")
    assert len(ok.knobs) == 5


SWEEP = ["--preset", "tiny", "--module", "gate_up_proj", "--tokens", "4", "--rank", "8",
         "--once"]


@pytest.mark.parametrize("argv, says", [
    (["--kernel", "shrink", "--grid", "num_warps=1,2", "num_warps=4"],
     "--grid 'num_warps=4': num_warps is already in the grid"),
    (["--kernel", "expand", "--grid", "block_n=3"], "block_n values must be powers of 2"),
    (["--kernel", "shrink", "--grid", "num_warps=4,6"], "num_warps values must be powers of 2"),
    # more adapters than tokens: a prefill layout held one request of all tokens while the
    # floors counted every adapter's weights
    (["--kernel", "shrink", "--adapters", "5"], "--adapters 5 is more than --tokens 4"),
])
def test_sweep_refuses_a_repeated_or_unlaunchable_grid_item(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(sweep.kernel_bench, "make_weights", _never)
    with pytest.raises(SystemExit) as e:
        sweep.main(SWEEP + argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_run_records_the_command_it_ran_not_its_caller_s(monkeypatch, tmp_path):
    """Under ``python -m bench.profile FILTER`` the run recorded ``python -m bench FILTER
    --out DIR``: the profile tool's arguments, which ``python -m bench`` does not take."""
    monkeypatch.setattr(cli.sys, "argv", ["bench/profile.py", "idle_forward", "--out", "x"])
    seen = {}

    def stop(device, dtype):
        raise SystemExit(0)

    real = cli.provenance.collect

    def collect(*a, **k):
        seen["run"] = real(*a, **k)
        return seen["run"]

    monkeypatch.setattr(cli.provenance, "collect", collect)
    monkeypatch.setattr(cli.hardware, "measure", stop)
    argv = ["--profile", "cpu", "--filter", "idle_forward", "--out", str(tmp_path / "run"),
            "--no-report"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert seen["run"]["command"] == "python -m bench " + " ".join(argv)
    from bench import dp_bench
    dp_bench._run_record(["--sizes", "1"])
    assert seen["run"]["command"] == "python -m bench.dp_bench --sizes 1"


def test_list_names_a_gpu_profile_s_cases_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    assert cli.main(["--profile", "gpu", "--list", "--suite", "kernels"]) == 0
    out = capsys.readouterr().out
    assert "# kernels: 160 cases (profile gpu)" in out
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--profile", "gpu", "--suite", "kernels"])


def test_an_out_into_the_committed_results_needs_publish(monkeypatch, tmp_path):
    """``--out results`` upserted the run's rows into the committed reference files without
    ``--publish``."""
    published = tmp_path / "results"
    published.mkdir()
    monkeypatch.setattr(cli, "RESULTS", published)

    def measured(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(cli.hardware, "measure", measured)
    argv = ["--profile", "cpu", "--suite", "idle", "--filter", "idle_forward", "--out"]
    for out in (published, tmp_path / "x" / ".." / "results"):
        with pytest.raises(SystemExit, match=f"--out {out} is the committed results folder"):
            cli.main(argv + [str(out)])
    with pytest.raises(AssertionError, match="measured"):  # with --publish it runs
        cli.main(argv + [str(published), "--publish"])
