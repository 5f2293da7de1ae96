"""The report on inputs users make by accident: the same rows read twice (a run folder and the
results it published), a headline case that failed, a profile session's folder, broken or
hand-edited result files, baselines with nothing to compare or no usable median, runs of
other layer counts beside each other, and output paths that cannot be written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import profile as bench_profile  # noqa: E402
from bench import report, report_charts  # noqa: E402


def _result(path: Path, data_rows: list[dict], run: dict = RUN) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data_rows = [r | {"run_id": run["run_id"]} for r in data_rows]
    path.write_text(json.dumps({"schema": 2, "runs": {run["run_id"]: run}, "rows": data_rows}))
    return path


def _count(page: str, suite: str, status: str = "verified") -> int:
    return int(re.search(rf"<td>{suite}</td><td>{status}</td><td>(\d+)</td>", page).group(1))


def test_rows_read_twice_count_once(tmp_path):
    run = _result(tmp_path / "run" / "kernels.json", rows())
    published = _result(tmp_path / "results" / "kernels.json", rows())
    once = report.write_report([run], [], tmp_path / "once.html").read_text()
    for paths in ([run, published], [run.parent, run], [run, run]):
        page = report.write_report(paths, [], tmp_path / "r.html").read_text()
        assert _count(page, "kernels") == _count(once, "kernels")
        assert _count(page, "model") == _count(once, "model")
        assert "superseded" not in page
    page = report.write_report([run], [published], tmp_path / "b.html").read_text()
    timed = sum(1 for r in rows() if r.get("stats"))
    assert f"<p>{timed} rows in both runs;" in page


def test_the_kernel_headline_skips_a_failed_top_case(tmp_path):
    data = rows()
    for r in data:  # the largest qkv_proj case at T=16 fails, untimed
        if (r["suite"], r.get("module"), r.get("tokens"), r.get("adapters")) == (
                "kernels", "qkv_proj", 16, 4):
            r["stats"], r["verification"] = None, {"status": "failed", "error": "bad"}
    page = report.write_report([_result(tmp_path / "k.json", data)], [],
                               tmp_path / "r.html").read_text()
    head = page.split("Headline: kernels")[1].split("<details>")[0]
    assert re.findall(r"<td>qkv_proj</td><td>16</td><td>(\d+)</td>", head) == ["1"]
    failed = page.split("<h3>Failed cases</h3>")[1].split("</table>")[0]
    assert failed.count("<tr><td>kernels qkv_proj T=16 adapters=4") == 1, "one line a case"


def test_a_kernel_headline_with_no_case_passed_says_so(tmp_path):
    data = [r | {"stats": None, "verification": {"status": "failed", "error": "bad"}}
            if r["suite"] == "kernels" else r for r in rows()]
    page = report.write_report([_result(tmp_path / "k.json", data)], [],
                               tmp_path / "r.html").read_text()
    head = page.split("Headline: kernels")[1].split("<details>")[0]
    n = len({(r["module"], r["tokens"], r["adapters"], r["rank"]) for r in data
             if r["suite"] == "kernels"})
    assert f"None of the {n} kernel cases was timed and verified" in head
    assert "<table" not in head, "no empty headline table"


def test_a_profile_session_s_rows_never_win(tmp_path, monkeypatch):
    runs = tmp_path / "results" / "runs"
    real = _result(runs / "20260101-000000-cpu" / "k.json", rows())
    profiled = RUN | {"run_id": "20260102-000000-abc", "profiled_by": "torch"}
    _result(runs / "20260102-000000-cpu-profile" / "k.json", rows(scale=5.0), profiled)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert report.main([]) == 0
    assert (real.parent / "report.html").exists()
    assert report.newest_run_folder(runs) == real.parent
    page = report.write_report([runs / "20260102-000000-cpu-profile", real.parent], [],
                               tmp_path / "r.html").read_text()
    assert "(under torch)" in page and f"{len(rows())} rows superseded" in page
    kernels = page.split("Headline: kernels")[1].split("<details>")[0]
    assert "<td>8.1</td>" in kernels, "the unprofiled run's medians are shown"


@pytest.mark.parametrize("mutate, says", [
    (lambda d: d.update(schema="2"), "'schema' is '2'"),
    (lambda d: d["rows"].insert(0, 7), "row 0 is int"),
    (lambda d: d.pop("runs"), "no 'runs'"),
    (lambda d: d["rows"][0].pop("verification"), "row 0 has no verification"),
    (lambda d: d["rows"][0].update(case_key="module"), "must be lists"),
    (lambda d: d["rows"][0].update(stats=[1]), "'stats' is neither"),
    # A KeyError traceback from the tables, naming no file:
    (lambda d: d["rows"][0].pop("module"), "row 0: its case_key names 'module'"),
    (lambda d: d["rows"][0].pop("provider"), "row 0: its variant names 'provider'"),
    # Read as the current schema, whatever its rows had become:
    (lambda d: d.update(schema=3), "schema 3 is newer than this checkout reads (2)"),
    # A KeyError / TypeError / AttributeError traceback from the tables and charts:
    (lambda d: d["rows"][0]["stats"].pop("median_us"), "row 0: 'stats' has no numeric 'median"),
    (lambda d: d["rows"][0]["stats"].update(median_us="12"), "row 0: 'stats' has no numeric"),
    (lambda d: d["rows"][0].update(derived=None), "row 0: 'derived' is not an object"),
    (lambda d: d["rows"][0].pop("derived"), "row 0: 'derived' is not an object"),
    (lambda d: d["rows"][0]["verification"].update(status=None), "'status' text"),
])
def test_a_malformed_result_file_is_an_error_naming_it(tmp_path, mutate, says):
    path = _result(tmp_path / "k.json", rows()[:4])
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=re.escape(str(path)) + ".*" + re.escape(says)):
        report.main([str(path), "-o", str(tmp_path / "r.html")])


def test_run_records_with_null_fields_still_report(tmp_path):
    run = RUN | {"suite_seconds": {"kernels": None}, "git_sha": None, "ceilings": None}
    page = report.write_report([_result(tmp_path / "k.json", rows()[:4], run)], [],
                               tmp_path / "r.html").read_text()
    assert "kernels -" in page


def test_a_report_page_is_not_a_result_file(tmp_path):
    page = tmp_path / "report.html"
    page.write_text("<html></html>")
    with pytest.raises(SystemExit, match="not a result file"):
        report.main([str(page), "-o", str(tmp_path / "r.html")])


@pytest.mark.parametrize("median", [0.0, None, math.inf])
def test_baseline_rows_without_a_usable_median_are_not_compared(median):
    base = [r | {"device": "g"} for r in rows() if r.get("stats")]
    base[0] = base[0] | {"stats": base[0]["stats"] | {"median_us": median}}
    _, pairs = report.deltas(base, base)
    assert len(pairs) == len(base) - 1 and all(v == 1.0 for _, v in pairs)
    _, pairs = report.deltas(base[:1], base[1:])
    assert pairs == []


def test_a_baseline_of_another_device_says_why_nothing_compared():
    mine = [r | {"device": "cpu"} for r in rows()]
    text, pairs = report.deltas(mine, [r | {"device": "NVIDIA H200"} for r in rows()])
    assert pairs == [] and "devices (NVIDIA H200) are not this run&#x27;s (cpu)" in text
    text, _ = report.deltas(mine, mine)
    assert "Nothing compared" not in text


def test_runs_of_other_layer_counts_never_share_a_line_or_bar():
    def at(layers, data):
        return [r | {"layers": layers} for r in data]
    two = at(4, rows()) + at(2, rows(scale=0.5))
    for chart, suite in ((report_charts.dp, "dp"), (report_charts.idle, "idle"),
                         (report_charts.throughput, "throughput")):
        mine = [r for r in two if r["suite"] == suite]
        alone = [r for r in rows() if r["suite"] == suite]
        traces = [t for f in chart(mine) for t in f.data]
        names_x = [(f.layout.title.text, t.name, tuple(t.x)) for f in chart(mine) for t in f.data]
        assert len(names_x) == len(set(names_x)), suite
        points = sum(len(t.x) for t in traces)
        assert points == 2 * sum(len(t.x) for f in chart(alone) for t in f.data), suite
        assert all(len(set(t.x)) == len(t.x) for t in traces), suite
    assert "layers=" not in str([t.name for f in report_charts.dp(rows()) for t in f.data])


def test_an_output_that_cannot_be_written_is_an_error(tmp_path):
    k = _result(tmp_path / "k.json", rows()[:4])
    with pytest.raises(SystemExit, match="is a folder"):
        report.main([str(k), "-o", str(tmp_path)])
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        bench_profile.main(["^kernels qkv_proj T=1 adapters=1 r=8$", "--out", str(afile)])


def test_the_profile_session_refuses_a_gpu_profile_without_a_gpu_first(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_profile.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "p"
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_profile.main(["x", "--profile", "gpu", "--out", str(out)])
    assert not out.exists()
    with pytest.raises(SystemExit, match="^the filter 'nomatch' matches no case"):
        bench_profile.main(["nomatch", "--out", str(out)])


def test_verification_lists_each_suite_s_checks_and_worst_errors():
    """The report gave only a count per status: what a verified row was checked against,
    and how close it came, were in the JSON alone."""
    ok = {"status": "verified", "error": None}
    got = report.checked([
        {"suite": "model", "verification": {**ok, "max_rel_err_vs_eager": 1e-7,
                                            "checks": ["replay == eager"]}},
        {"suite": "model", "verification": {**ok, "max_rel_err_vs_eager": 3e-7,
                                            "checks": ["replay == eager", "merged"]}},
        {"suite": "model", "verification": {"status": "failed", "error": "x",
                                            "max_rel_err_vs_eager": 9.0}},
        {"suite": "dp", "verification": {**ok, "checked": "count", "reference_probes": 8,
                                         "reference_mismatches": 1}},
        {"suite": "dp", "verification": {**ok, "checked": "count", "reference_probes": 8,
                                         "reference_mismatches": 0}},
    ])
    assert got == [["dp", "count", "-", "1 of 16"],
                   ["model", "replay == eager; merged", "max_rel_err_vs_eager 3e-07", "-"]]


def test_a_schema_1_row_without_its_fields_is_an_error_naming_it(tmp_path):
    """Old files were migrated field by field: a missing one was a KeyError traceback."""
    old = {"schema": 1, "runs": {"r1": {"profile": "cpu"}}, "rows": [
        {"suite": "kernels", "run_id": "r1", "module": "qkv_proj", "tokens": 1, "adapters": 1,
         "rank": 8, "dtype": "float32", "provider": "triton", "median_us": 5.0},
        {"suite": "model", "kind": "decode_step", "run_id": "r1", "traffic": "base"}]}
    path = tmp_path / "model-cpu.json"
    path.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match=re.escape(str(path)) + ".*row 1 of schema 1 has no "
                       "'runtime'"):
        report.main([str(path), "-o", str(tmp_path / "r.html")])


def test_a_schema_1_row_without_a_median_reads_as_not_timed(tmp_path):
    """It was migrated to stats with a null median: a TypeError in the graph-vs-eager chart."""
    old = json.loads((Path(__file__).parent.parent / "results" / "model-cpu.json").read_text())
    for r in old["rows"]:
        if r.get("path") == "eager":
            del r["median_us"]
    path = tmp_path / "model-cpu.json"
    path.write_text(json.dumps(old))
    page = report.write_report([path], [], tmp_path / "r.html").read_text()
    assert "Graph speed-up over eager" not in page and "No model rows." in page
    rows = [r for r in report.results.load(path)["rows"] if r["path"] == "eager"]
    assert rows and all(r["stats"] is None for r in rows)


def test_a_base_step_row_without_its_roofline_figure_is_left_out_of_its_chart():
    """A KeyError traceback ended the report."""
    steps = [r for r in rows() if r["suite"] == "base_step"]
    steps[0] = steps[0] | {"derived": {}}
    [fig] = report_charts.base_step(steps)
    assert [len(t.x) for t in fig.data] == [1]


def test_base_step_lines_of_two_presets_or_dtypes_are_drawn_apart():
    """Rows of another preset or dtype with the same layers, context and kernels shared a
    line (its points zig-zagging between two models)."""
    steps = [r for r in rows() if r["suite"] == "base_step"
             and isinstance(r["derived"].get("pct_of_roofline"), (int, float))]
    other = [r | {"preset": "other", "dtype": "float16"} for r in steps]
    lines = {t.name: len(t.x) for t in report_charts.base_step(steps + other)[0].data}
    alone = {t.name: len(t.x) for t in report_charts.base_step(steps)[0].data}
    assert len(lines) == 2 * len(alone) and sorted(lines.values()) == sorted(
        list(alone.values()) * 2)
    assert all("preset=" in name and "dtype=" in name for name in lines)
    assert not any("preset=" in name for name in alone)


def test_a_case_timed_in_the_baseline_that_fails_now_is_flagged():
    """It was left out of the comparison: "0 regressions", the failure only under
    Verification."""
    base = [r | {"device": "g"} for r in rows() if r.get("stats")]
    now = list(base)
    now[0] = now[0] | {"stats": None, "verification": {"status": "failed", "error": "boom"}}
    text, pairs = report.deltas(now, base)
    assert len(pairs) == len(base) - 1
    assert "<b>1</b> rows timed in the baseline fail now" in text and "FAILS NOW" in text
    text, pairs = report.deltas(now[:1], base)
    assert pairs == [] and "Nothing compared" not in text and "FAILS NOW" in text
