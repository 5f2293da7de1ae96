"""Result files and the report against what a sixth hunt found: a run of another device
written into the same file keeps the first device's rows; a file the run would crash on
(a row without ``run_id``, a case field holding a list, run records of the wrong shapes) is
refused on load, naming the field, before anything is measured; text where a figure belongs
is shown, not a crash; suites whose every case failed say so; ``--screenshot`` never
replaces the report it shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import report, results, table  # noqa: E402

OTHER = RUN | {"run_id": "20260103-000000-def", "device": "Other GPU"}


def _file(path: Path, data_rows: list[dict], runs: dict | None = None) -> Path:
    runs = runs if runs is not None else {RUN["run_id"]: RUN}
    run_id = next(iter(runs))
    path.write_text(json.dumps({"schema": 2, "runs": runs,
                                "rows": [{"run_id": run_id} | r for r in data_rows]}))
    return path


def test_a_run_of_another_device_into_the_same_file_keeps_the_first_devices_rows(tmp_path):
    path = tmp_path / "dp.json"
    some = [r for r in rows() if r["suite"] == "dp"]
    results.upsert(path, RUN, some)
    results.upsert(path, OTHER, some)
    data = results.load(path)
    by_device = {}
    for r in data["rows"]:
        dev = data["runs"][r["run_id"]]["device"]
        by_device[dev] = by_device.get(dev, 0) + 1
    assert by_device == {"Fake GPU": len(some), "Other GPU": len(some)}
    results.upsert(path, OTHER | {"run_id": "20260104-000000-xyz"}, some[:1])
    data = results.load(path)
    assert len(data["rows"]) == 2 * len(some), "a re-run replaces its own device's row only"
    assert set(data["runs"]) == {RUN["run_id"], OTHER["run_id"], "20260104-000000-xyz"}


def _first_kernel_row() -> dict:
    return next(r for r in rows() if r["suite"] == "kernels")


@pytest.mark.parametrize("mutate, says", [
    (lambda d: d["rows"][0].pop("run_id"), "run_id"),
    (lambda d: d["rows"][0].update(run_id=7), "run_id"),
    (lambda d: d["rows"][0].update(suite=None), "suite"),
    (lambda d: d["rows"][0].update(tokens=[1, 2]), "tokens"),
    (lambda d: d["rows"][0].update(provider={"a": 1}), "provider"),
    (lambda d: d["rows"][0]["case_key"].append(["x"]), "field names"),
    (lambda d: d["runs"][RUN["run_id"]].update(ceilings=[1]), "ceilings"),
    (lambda d: d["runs"][RUN["run_id"]].update(suite_seconds=[1]), "suite_seconds"),
    (lambda d: d["runs"][RUN["run_id"]].update(suite_seconds={"kernels": "x"}),
     "suite_seconds"),
    (lambda d: d["runs"][RUN["run_id"]].update(device=3), "device"),
    (lambda d: d["runs"].update(x=[]), "not an object"),
])
def test_a_malformed_file_is_refused_on_load_naming_the_field(tmp_path, mutate, says):
    path = _file(tmp_path / "kernels.json", [_first_kernel_row()])
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(results.ResultFileError, match=says):
        results.load(path)
    with pytest.raises(results.ResultFileError, match=says):  # before any row is written
        results.upsert(path, RUN, [_first_kernel_row()])
    with pytest.raises(SystemExit, match=says):
        report.main([str(path), "-o", str(tmp_path / "r.html")])


def test_a_figure_the_report_computes_with_must_be_a_number(tmp_path):
    row = next(r for r in rows() if r["suite"] == "model" and "lora_floor_us" in r["derived"])
    path = _file(tmp_path / "model.json", [row | {"derived": {"lora_floor_us": "n/a"}}])
    with pytest.raises(results.ResultFileError, match="derived.lora_floor_us"):
        results.load(path)
    # Other derived fields may hold text (an attention row's regime, a DP row's workload).
    _file(path, [row | {"derived": {"lora_floor_us": None, "note": "text"}}])
    assert results.load(path)["rows"][0]["derived"]["note"] == "text"


def test_text_in_a_verification_count_or_a_table_cell_is_no_crash(tmp_path):
    bad = [r | {"verification": r["verification"] | {"reference_probes": 4,
                                                     "reference_mismatches": "x"}}
           for r in rows() if r["suite"] == "throughput"]
    page = report.write_report([_file(tmp_path / "t.json", bad)], [],
                               tmp_path / "r.html").read_text()
    assert "Throughput" in page
    assert table.fmt("n/a") == "n/a" and table.fmt(None) == "-" and table.fmt(2.25) == "2.2"


def test_suites_whose_every_case_failed_say_so(tmp_path):
    failed = [r | {"stats": None, "derived": {},
                   "verification": {"status": "failed", "error": "boom"}}
              for r in rows() if r["suite"] in ("kernels", "model", "throughput")]
    page = report.write_report([_file(tmp_path / "f.json", failed)], [],
                               tmp_path / "r.html").read_text()
    for suite in ("kernels", "model", "throughput"):
        n = len({results.case_id(r) for r in failed if r["suite"] == suite})
        noun = "kernel" if suite == "kernels" else suite
        assert f"None of the {n} {noun} cases was timed and verified" in page
    model = page.split("Headline: whole-model step")[1].split("<h2>")[0]
    assert "None of the" in model and "<table" not in model
    assert "No kernel rows." not in page and "No model rows." not in page


def test_the_screenshot_never_replaces_the_report_it_shows(tmp_path):
    src = _file(tmp_path / "k.json", [_first_kernel_row()])
    same = tmp_path / "same.png"
    with pytest.raises(SystemExit, match="html"):
        report.main([str(src), "-o", str(same), "--screenshot", str(same)])
    page = tmp_path / "r.html"
    with pytest.raises(SystemExit, match="give a .png path"):
        report.main([str(src), "-o", str(page), "--screenshot", str(page)])
    assert not same.exists() and not page.exists(), "refused before anything was written"


def test_a_profiled_run_whose_case_failed_still_gets_its_summary(tmp_path, capsys):
    """nsys passes the profiled run's exit status on: a case that failed verification made
    the session return before the per-range summary of what did run."""
    import stat

    from bench import profile as bench_profile
    nsys = tmp_path / "nsys"
    nsys.write_text('#!/bin/sh\nif [ "$1" = profile ]; then touch "$6.nsys-rep"; exit 3; fi\n'
                    'echo "range summary"\n')
    nsys.chmod(nsys.stat().st_mode | stat.S_IXUSR)
    assert bench_profile._nsys(str(nsys), [], tmp_path) == 3
    out = capsys.readouterr().out
    assert "exited with status 3" in out and "range summary" in out
    assert (tmp_path / "ranges.txt").read_text().strip() == "range summary"
    (tmp_path / "profile.nsys-rep").unlink()  # no report at all: nothing to summarise
    nsys.write_text('#!/bin/sh\nif [ "$1" = profile ]; then exit 2; fi\necho never\n')
    assert bench_profile._nsys(str(nsys), [], tmp_path) == 2
    assert "never" not in capsys.readouterr().out
