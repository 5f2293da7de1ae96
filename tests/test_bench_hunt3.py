"""Benchmark-tool inputs and situations a third hunt found mishandled: an empty ``--out`` read
as the working folder, a DP run whose cases failed exiting 0, a DP ``--out`` that no tool
could read back, run records with a null device or suite seconds crashing the report, a
failing ``nsys stats`` leaving the summary out without a word, and a git that could not run
recorded as a clean tree."""

from __future__ import annotations

import json
import os
import stat

import pytest
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from cli_checks import never, usage_error

from bench import cli, dp_bench, provenance, report, results  # noqa: E402
from bench import profile as bench_profile  # noqa: E402
from bench.results import make_row  # noqa: E402
from bench.scenarios import DPCase  # noqa: E402

DP = ["--preset", "tiny", "--layers", "1", "--requests-per-rank", "1", "--prompt", "4",
      "--output", "2", "--max-batch", "2", "--adapters", "0", "--loads", "skewed"]


def test_an_empty_out_is_refused_not_read_as_the_working_folder(monkeypatch, capsys, tmp_path):
    """``--out "$DIR"`` with ``DIR`` unset: ``Path("")`` is ``.``, and the run wrote its result
    files and report into the working directory (the repository root under nox)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.hardware, "measure", never)
    usage_error(capsys, cli.main, ["--profile", "cpu", "--suite", "attention", "--out", ""],
                 "argument --out: an empty path")
    usage_error(capsys, bench_profile.main, ["attention decode", "--profile", "cpu",
                                              "--out", " "], "argument --out: an empty path")
    assert list(tmp_path.iterdir()) == []


def _fake_spawn(status: str):
    def spawn(fn, nprocs, size, opts, part, timeout_s):
        case = DPCase("tiny", 1, "float32", size, "skewed", 0, "-")
        error = None if status == "verified" else "the timed pass produced 3 tokens"
        row = make_row(case, "cpu", {}, verification={"status": status, "error": error})
        with open(part, "w") as f:
            json.dump([row], f)
    return spawn


@pytest.mark.parametrize("status, code", [("failed", 1), ("verified", 0)])
def test_dp_bench_exits_non_zero_naming_a_failed_case(monkeypatch, capsys, tmp_path, status,
                                                       code):
    """A DP case that failed its verification was written as failed, but the tool exited 0."""
    monkeypatch.setattr(dp_bench, "spawn", _fake_spawn(status))
    out = tmp_path / "dp.json"
    assert dp_bench.main(DP + ["--sizes", "1", "2", "--out", str(out)]) == code
    printed = capsys.readouterr().out
    assert ("FAILED dp size=1 skewed tiny L=1 no-lora: the timed pass produced 3 tokens"
            in printed) == (status == "failed")
    assert ("FAILED dp size=2" in printed) == (status == "failed")
    assert {r["verification"]["status"] for r in results.load(out)["rows"]} == {status}


def test_dp_bench_refuses_an_out_that_is_not_a_json_file(monkeypatch, capsys, tmp_path):
    """``--out dp`` wrote a file that bench.report and the next run into it refused as not a
    result file (they read result files by their .json suffix)."""
    monkeypatch.setattr(dp_bench, "spawn", never)
    usage_error(capsys, dp_bench.main, DP + ["--out", str(tmp_path / "dp")],
                 f"--out {tmp_path / 'dp'}: result files end in .json")
    usage_error(capsys, dp_bench.main, DP + ["--out", str(tmp_path / "dp.txt")],
                 f"give e.g. {tmp_path / 'dp.json'}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field", ["device", "suite_seconds"])
def test_run_records_with_a_null_device_or_suite_seconds_still_report(tmp_path, field):
    """Null fields of a run record report (``ceilings``, ``git_sha``), but a null ``device``
    beside another run's device was a TypeError sorting the devices, and a null
    ``suite_seconds`` one merging the run's seconds over its files."""
    other = RUN | {"run_id": "20260102-000000-def", "device": "Other GPU"}
    for name, run in (("a.json", RUN | {field: None}), ("b.json", other)):
        (tmp_path / name).write_text(json.dumps({
            "schema": 2, "runs": {run["run_id"]: run},
            "rows": [r | {"run_id": run["run_id"]} for r in rows()[:8]]}))
    page = report.write_report([tmp_path], [tmp_path], tmp_path / "r.html").read_text()
    assert "qkv_proj" in page and "Other GPU" in page


def test_a_failing_nsys_stats_says_the_summary_is_missing(tmp_path, capsys):
    """With nsys, the per-range summary comes from ``nsys stats``; when both report names
    failed (an nsys that names them otherwise), the summary was left out without a word."""
    nsys = tmp_path / "nsys"
    nsys.write_text('#!/bin/sh\nif [ "$1" = profile ]; then exit 0; fi\n'
                    'echo "ERROR: report \'$3\' could not be found" >&2\nexit 1\n')
    nsys.chmod(nsys.stat().st_mode | stat.S_IXUSR)
    assert bench_profile._nsys(str(nsys), [], tmp_path) == 0
    out = capsys.readouterr().out
    assert "no per-range summary: nsys stats --report nvtx_sum,cuda_gpu_kern_sum failed" in out
    assert "could not be found" in out and not (tmp_path / "ranges.txt").exists()


def test_a_git_that_cannot_run_records_the_tree_as_of_unknown_state(monkeypatch, tmp_path):
    """git failing (not a repository to it, or one it refuses as of dubious ownership) printed
    nothing, which read as a clean tree: the report showed no dirty flag beside sha
    'unknown'."""
    if not (provenance.ROOT / ".git").exists():
        pytest.skip("a copy without .git records git_dirty null anyway")
    monkeypatch.delenv("MULTILORA_GIT_SHA", raising=False)
    monkeypatch.setenv("GIT_DIR", os.fspath(tmp_path / "not-a-repository"))
    assert provenance._dirty() is None
    assert provenance._sha() == "unknown"
