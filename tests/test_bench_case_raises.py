"""A case whose verification (or any of its work) raises must be recorded as failed, and the
run go on to its other cases and exit non-zero: it ended the whole run with a traceback,
leaving no row for the case (nor for the suites after it) and no report."""

from __future__ import annotations

import dataclasses
import json

from bench import cli, results


def test_a_case_that_raises_is_recorded_failed_and_the_run_exits_non_zero(monkeypatch, tmp_path):
    def start(todo, ctx):
        def run(case):
            raise RuntimeError("boom in verification")
        return run

    suite = dataclasses.replace(cli.SUITES["attention"], start=start)
    monkeypatch.setitem(cli.SUITES, "attention", suite)
    rc = cli.main(["--profile", "cpu", "--suite", "attention", "--out", str(tmp_path),
                   "--no-report"])
    assert rc == 1
    [f] = tmp_path.glob("attention-*.json")
    rows = results.load(f)["rows"]
    assert len(rows) == len(suite.cases("cpu")) and all(
        r["verification"]["status"] == "failed" and "boom in verification" in
        r["verification"]["error"] and r["stats"] is None for r in rows)
    json.dumps(rows)


def test_a_failed_row_carries_no_timing():
    """Failed throughput and DP rows kept their timing and tokens/s: ``--publish`` wrote them
    into the committed results and the report charted them like verified ones."""
    from bench.timing import Timing

    case = cli.SUITES["attention"].cases("cpu")[0]
    kept = results.make_row(case, "cpu", {}, timing=Timing([1.0, 2.0], "wall"),
                            derived={"tokens_per_s": 5.0}, verification={"status": "verified"})
    assert kept["stats"] is not None and kept["derived"]
    row = results.make_row(case, "cpu", {}, timing=Timing([1.0, 2.0], "wall"),
                           derived={"tokens_per_s": 5.0},
                           verification={"status": "failed", "error": "wrong tokens"})
    assert row["stats"] is None and row["samples_us"] == [] and row["derived"] == {}
    assert row["verification"]["error"] == "wrong tokens"
