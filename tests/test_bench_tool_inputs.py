"""Inputs of ``python -m bench`` and ``python -m bench.report`` that silently did the wrong
thing: ``--suite`` given twice ran only the last flag's suites, and ``-o`` naming a result file
overwrote it with the HTML page (and a ``.json`` page in a run folder broke that folder's next
report as a "truncated or corrupt" result file)."""

from __future__ import annotations

import json

import pytest
import torch
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import cli, report  # noqa: E402


@pytest.mark.parametrize("argv, want", [
    (["--suite", "kernels", "--suite", "model"], ["kernels", "model"]),
    (["--suite", "kernels", "model", "--suite", "kernels"], ["kernels", "model"]),
    (["--suite", "kernels", "--suite", "all"], list(cli.SUITES)),
    ([], list(cli.SUITES)),
])
def test_suite_given_twice_runs_both(argv, want):
    args = cli.parse_args(argv + ["--filter", "."])
    assert list(cli.select(args, "cpu")) == want


def test_a_report_over_a_result_file_is_refused_and_the_file_kept(tmp_path):
    k = tmp_path / "kernels-x.json"
    k.write_text(json.dumps({"schema": 2, "runs": {RUN["run_id"]: RUN},
                             "rows": [r | {"run_id": RUN["run_id"]} for r in rows()[:4]]}))
    before = k.read_text()
    for out in (k, tmp_path / "report.json"):
        with pytest.raises(SystemExit, match=rf"-o {out}: .*\.html"):
            report.main([str(k), "-o", str(out)])
    assert k.read_text() == before and not (tmp_path / "report.json").exists()
    report.main([str(k), "-o", str(tmp_path / "report.html")])
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_a_profile_into_a_folder_of_results_is_refused_before_running(tmp_path, monkeypatch):
    """A profiled run upserts its case's rows: into a run folder it replaced the rows timed
    without a profiler by ones timed under it."""
    from bench import profile as bench_profile

    def never(*a, **k):
        raise AssertionError("profiled into a folder holding results")

    monkeypatch.setattr(bench_profile.cli, "main", never)
    monkeypatch.setattr(bench_profile.torch.cuda, "is_available", lambda: False)
    run = tmp_path / "run"
    run.mkdir()
    k = run / "kernels-cpu.json"
    k.write_text(json.dumps({"schema": 2, "runs": {RUN["run_id"]: RUN},
                             "rows": [r | {"run_id": RUN["run_id"]} for r in rows()[:4]]}))
    label = "^kernels qkv_proj T=1 adapters=1 r=8$"
    with pytest.raises(SystemExit, match=rf"--out {run}: .*result files.*fresh folder"):
        bench_profile.main([label, "--profile", "cpu", "--out", str(run)])
    (run / "trace.json").write_text("{}")  # a profile folder's trace alone is no result file
    k.unlink()
    with pytest.raises(AssertionError, match="profiled into"):
        bench_profile.main([label, "--profile", "cpu", "--out", str(run)])


def test_an_output_under_a_file_is_an_error_naming_it(tmp_path):
    """A traceback (FileExistsError / NotADirectoryError from the folder's mkdir) before."""
    k = tmp_path / "kernels-x.json"
    k.write_text(json.dumps({"schema": 2, "runs": {RUN["run_id"]: RUN},
                             "rows": [r | {"run_id": RUN["run_id"]} for r in rows()[:4]]}))
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile" / "r.html", tmp_path / "afile" / "sub" / "r.html"):
        with pytest.raises(SystemExit, match=rf"-o {out}: cannot write the report .*give "):
            report.main([str(k), "-o", str(out)])


def test_a_run_s_report_that_cannot_be_written_is_a_note_not_a_failure(tmp_path, capsys):
    (tmp_path / "report.html").mkdir()  # where cli's report goes
    cli._report(tmp_path)
    assert "no report: " in capsys.readouterr().out


def test_a_dp_case_under_the_torch_profiler_says_its_ranks_are_not_recorded(
        tmp_path, monkeypatch, capsys):
    """A DP case runs in spawned ranks: its range's table was a bare heading, unexplained."""
    from bench import profile as bench_profile
    from bench.profiles import dp_cases

    label = next(c.label for c in dp_cases("cpu") if c.dp_size == 2)

    def case_in_ranks(argv):  # the parent's range, its work done in other processes
        with torch.profiler.record_function(label):
            pass
        return 0

    monkeypatch.setattr(bench_profile.cli, "main", case_in_ranks)
    monkeypatch.setattr(bench_profile.torch.cuda, "is_available", lambda: False)
    assert bench_profile.main([f"^{label}$", "--profile", "cpu", "--out",
                               str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "spawned rank processes" in out and "nsys" in out
    heading = out.splitlines().index(next(ln for ln in out.splitlines()
                                          if ln.startswith(label)))
    assert "no ops recorded" in out.splitlines()[heading + 1]
