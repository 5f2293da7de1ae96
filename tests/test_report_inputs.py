"""What the benchmark CLIs do with the inputs a user gives them: JSON files that are not result
files, corrupt result files, an unusable ``--out``, repeated ``--baseline`` flags, a case run
twice, rows of several devices, ``--publish`` with a subset, an unknown profile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import cli, report, results, table  # noqa: E402
from bench import profile as bench_profile  # noqa: E402
from bench.host import __main__ as host_main  # noqa: E402

HOST_RUN = {"machine_info": {"multilora": {}}, "benchmarks": [], "version": "5.1.0"}
TRACE = {"traceEvents": [], "displayTimeUnit": "ms"}
CPU_RUN = RUN | {"run_id": "20260102-000000-abc", "profile": "cpu", "device": "cpu"}


def _result(path: Path, data_rows: list[dict], run: dict = RUN) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data_rows = [r | {"run_id": run["run_id"]} for r in data_rows]
    path.write_text(json.dumps({"schema": 2, "runs": {run["run_id"]: run}, "rows": data_rows}))
    return path


def _json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _verified(page: str, suite: str) -> int:
    return int(re.search(rf"<td>{suite}</td><td>verified</td><td>(\d+)</td>", page).group(1))


def test_a_folder_s_other_json_files_are_skipped_with_a_note(tmp_path, capsys):
    run = tmp_path / "run"
    _result(run / "kernels-h200.json", rows()[:8])
    host = _json(run / "host-cpu.json", HOST_RUN)
    trace = _json(run / "trace.json", TRACE)
    assert report.main([str(run), "-o", str(tmp_path / "r.html")]) == 0
    note = capsys.readouterr().err
    assert "skipped 2 JSON files that are not result files" in note
    assert str(host) in note and str(trace) in note
    assert "qkv_proj" in (tmp_path / "r.html").read_text()


def test_a_file_given_that_is_not_a_result_file_is_an_error_naming_it(tmp_path):
    host = _json(tmp_path / "host-cpu.json", HOST_RUN)
    with pytest.raises(SystemExit, match=re.escape(str(host)) + ".*not a benchmark result"):
        report.main([str(host), "-o", str(tmp_path / "r.html")])


def test_the_default_is_the_newest_run_folder_holding_result_files(tmp_path, monkeypatch):
    runs = tmp_path / "results" / "runs"
    _result(runs / "20260101-000000-cpu" / "kernels-cpu.json", rows()[:8])
    _json(runs / "20260102-000000-cpu-profile" / "trace.json", TRACE)
    (runs / "20260103-000000-cpu").mkdir()  # a run stopped before its first case
    _json(runs / "host" / "20260104-000000-cpu.json", HOST_RUN)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert report.main([]) == 0
    assert (runs / "20260101-000000-cpu" / "report.html").exists()
    assert not (runs / "20260102-000000-cpu-profile" / "report.html").exists()


def test_no_rows_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no result rows"):
        report.main([str(tmp_path / "empty"), "-o", str(tmp_path / "r.html")])


def test_a_truncated_result_file_is_an_error_naming_it(tmp_path):
    good = _result(tmp_path / "run" / "kernels-cpu.json", rows()[:8])
    bad = tmp_path / "run" / "model-cpu.json"
    bad.write_text(good.read_text()[:100])
    for given in (bad, bad.parent):
        with pytest.raises(SystemExit, match=re.escape(str(bad)) + ": not valid JSON"):
            report.main([str(given), "-o", str(tmp_path / "r.html")])


def _cli_stops_before_measuring(monkeypatch, out: Path) -> str:
    def measured(*a, **k):
        raise AssertionError("measured before the --out check")

    monkeypatch.setattr(cli.hardware, "measure", measured)
    with pytest.raises(SystemExit) as e:
        cli.main(["--profile", "cpu", "--suite", "kernels", "--filter",
                  "qkv_proj T=1 adapters=1 r=8$", "--out", str(out)])
    return str(e.value)


def test_a_run_into_a_corrupt_result_file_stops_before_measuring(tmp_path, monkeypatch):
    bad = tmp_path / "run" / "kernels-cpu.json"
    bad.parent.mkdir()
    bad.write_text('{"schema": 2, "runs": {}, "rows": [{"suite": "ker')
    msg = _cli_stops_before_measuring(monkeypatch, bad.parent)
    assert str(bad) in msg and "not valid JSON" in msg


def test_a_publish_into_a_corrupt_result_file_leaves_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "RESULTS", tmp_path)
    bad = tmp_path / "kernels-cpu.json"
    bad.write_text('{"schema": 2, "runs": {}, "rows": [{"suite": "ker')
    monkeypatch.setattr(cli.hardware, "measure", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit, match="not valid JSON"):
        cli.main(["--profile", "cpu", "--suite", "kernels", "--filter",
                  "qkv_proj T=1 adapters=1 r=8$", "--publish"])
    assert not (tmp_path / "runs").exists(), "a refused run made its run folder"


def test_a_publish_into_a_results_folder_it_cannot_write_leaves_no_run_folder(tmp_path,
                                                                             monkeypatch):
    """It ran the first case, then failed with a traceback writing the published file."""
    published = tmp_path / "results"
    monkeypatch.setattr(cli, "RESULTS", published)
    monkeypatch.setattr(cli.hardware, "measure", lambda *a: pytest.fail("measured"))
    access = cli.os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: Path(p) != published
                        and access(p, mode))
    out = tmp_path / "run"
    argv = ["--profile", "cpu", "--suite", "kernels", "--filter", "qkv_proj T=1 adapters=1 r=8$",
            "--publish", "--out", str(out)]
    published.write_text("")  # a file where the folder should be
    with pytest.raises(SystemExit, match=f"--publish: {published} is not a writable folder"):
        cli.main(argv)
    published.unlink()
    published.mkdir()  # read-only (as os.access says)
    with pytest.raises(SystemExit, match=f"--publish: {published} is not a writable folder"):
        cli.main(argv)
    assert not out.exists(), "a refused run made its run folder"


def test_an_out_that_is_a_file_or_cannot_be_made_stops_before_measuring(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file" in _cli_stops_before_measuring(monkeypatch, afile)
    assert "cannot create" in _cli_stops_before_measuring(monkeypatch, afile / "run")


def test_each_baseline_flag_takes_one_path(tmp_path, monkeypatch):
    a, b, c = (_result(tmp_path / f"{n}.json", rows()[:8]) for n in "abc")
    seen = []
    monkeypatch.setattr(report, "write_report",
                        lambda paths, base, out, need_rows: seen.append((paths, base)))
    report.main(["--baseline", str(a), str(b), "-o", str(tmp_path / "r.html")])
    report.main(["--baseline", str(a), "--baseline", str(c), str(b), "-o",
                 str(tmp_path / "r.html")])
    assert seen == [([b], [a]), ([b], [a, c])]


def test_a_case_run_twice_shows_the_latest_run_everywhere(tmp_path, capsys):
    later = RUN | {"run_id": "20260105-000000-abc"}
    first = _result(tmp_path / "a" / "kernels.json", rows(scale=1.0))
    second = _result(tmp_path / "b" / "kernels.json", rows(scale=3.0), later)
    out = report.write_report([second, first], [], tmp_path / "r.html")
    page = out.read_text()
    n = len(rows())
    assert f"{n} rows superseded by later runs of the same case" in page
    assert f"{n} rows superseded" in capsys.readouterr().out
    once = report.write_report([first], [], tmp_path / "once.html").read_text()
    assert _verified(page, "kernels") == _verified(once, "kernels")
    kept, superseded = results.latest_per_case(
        rows() + [r | {"run_id": later["run_id"]} for r in rows()[:4]],
        {RUN["run_id"]: RUN, later["run_id"]: later})
    assert superseded == 4 and len(kept) == n
    assert {r["run_id"] for r in kept[-4:]} == {later["run_id"]}


def test_a_case_a_later_run_skipped_keeps_the_rows_of_the_run_that_ran_it(tmp_path):
    """As upsert does: a later 2-GPU run skips DP 2 (and 4, 8), and its skipped rows hid the
    rows a run on more GPUs timed, in every table and chart of the report."""
    later = RUN | {"run_id": "20260105-000000-abc"}
    ran = _result(tmp_path / "a" / "dp.json", [r for r in rows() if r["suite"] == "dp"])
    skipped = [r | {"stats": None, "samples_us": [], "derived": {},
                    "verification": {"status": "skipped", "error": "needs 2 GPUs"}}
               for r in rows() if r["suite"] == "dp" and r["dp_size"] == 2]
    small = _result(tmp_path / "b" / "dp.json", skipped, later)
    both, runs = results.rows_of([ran, small])
    kept, superseded = results.latest_per_case(report.with_device(both, runs), runs)
    assert superseded == len(skipped)
    assert {r["verification"]["status"] for r in kept} == {"verified"}
    assert {r["run_id"] for r in kept} == {RUN["run_id"]}
    # a later run that ran the case again still supersedes the earlier one
    again = _result(tmp_path / "c" / "dp.json", [r for r in rows() if r["suite"] == "dp"
                                                 and r["dp_size"] == 2], later)
    both, runs = results.rows_of([ran, again])
    kept, _ = results.latest_per_case(report.with_device(both, runs), runs)
    assert {r["run_id"] for r in kept if r["dp_size"] == 2} == {later["run_id"]}


def test_rows_of_different_devices_never_merge(tmp_path):
    gpu = _result(tmp_path / "gpu.json", rows(scale=1.0))
    cpu = _result(tmp_path / "cpu.json", rows(scale=1000.0), CPU_RUN)
    page = report.write_report([gpu, cpu], [], tmp_path / "r.html").read_text()
    assert "superseded" not in page, "a CPU run of a case does not supersede a GPU one"
    kernels = page.split("Headline: kernels")[1].split("<h2>")[0]
    assert "<h3>Fake GPU</h3>" in kernels and "<h3>cpu</h3>" in kernels
    gpu_part = kernels.split("<h3>Fake GPU</h3>")[1].split("<h3>")[0]
    # qkv_proj T=1 at 4 adapters r=64: 8.05 us on the GPU, 8050 us on the CPU
    assert "<td>8.1</td>" in gpu_part and "8050.0" not in gpu_part
    assert "vs DP size (cpu)" in page
    assert "vs DP size (Fake GPU)" in page
    rs = report.with_device(rows(), {RUN["run_id"]: RUN})
    mixed = rs + [r | {"device": "cpu"} for r in rs]
    head, body = table.kernel_cells([r for r in mixed if r["suite"] == "kernels"])
    assert head[0] == "set-up" and len(body) == 2 * len(table.kernel_cells(
        [r for r in rs if r["suite"] == "kernels"])[1])
    text, pairs = report.deltas([r | {"device": "cpu"} for r in rs], rs)
    assert pairs == [], "a CPU row is never compared with a GPU baseline"


def test_publish_with_a_subset_is_refused_before_running(tmp_path):
    for subset in (["-k", "plan"], ["-kplan"], ["bench/host/test_host_path.py::test_lora_plan"]):
        with pytest.raises(SystemExit, match="--publish"):
            host_main.main(["--publish", "--out", str(tmp_path / "runs"), *subset])
    assert not (tmp_path / "runs").exists()


def test_an_unknown_profile_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_profile.main(["x", "--profile", "nosuch"])
    assert e.value.code == 2 and "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_the_report_and_result_files_are_utf_8_whatever_the_locale(tmp_path):
    """Read and written in the locale's encoding: under an ASCII locale every report was a
    UnicodeEncodeError traceback (plotly.js is not ASCII), and a UTF-8 result file "not valid
    JSON"; in another 8-bit locale the page contradicted its <meta charset="utf-8">."""
    run = RUN | {"device": "Fake GPU ☃"}
    k = tmp_path / "k.json"
    k.write_text(json.dumps({"schema": 2, "runs": {run["run_id"]: run}, "rows": [
        r | {"run_id": run["run_id"]} for r in rows()[:4]]}, ensure_ascii=False),
        encoding="utf-8")
    script = ("import sys; from pathlib import Path; from bench import report; "
              "report.write_report([Path(sys.argv[1])], [], Path(sys.argv[2]))")
    env = os.environ | {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
                        "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", script, str(k), str(tmp_path / "r.html")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Fake GPU ☃" in (tmp_path / "r.html").read_bytes().decode("utf-8")
