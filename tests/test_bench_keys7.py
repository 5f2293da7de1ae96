"""Row keys of the benchmark tools, after a review: a DP case's key held no workload, so a
``bench.dp_bench`` run of another workload (or ``--serial``) into the same file replaced the
earlier workload's rows; two runs of one sha started in the same second shared a ``run_id``;
the model suite's table and charts grouped rows without their ``backend``, so triton and
torch rows of one device merged."""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import dp_bench, profiles, provenance, report, report_charts, results, table  # noqa: E402

COMMITTED_DP = Path(__file__).resolve().parent.parent / "results" / "dp-nvidia-h200.json"
DP = ["--sizes", "1", "--preset", "tiny", "--layers", "1", "--requests-per-rank", "1",
      "--output", "2", "--max-batch", "1", "--adapters", "0", "--loads", "balanced",
      "--rank", "4", "--timeout", "60"]


def test_a_dp_bench_run_of_another_workload_keeps_the_first_workload_s_rows(tmp_path,
                                                                           monkeypatch):
    """A run at ``--prompt 4 --serial`` into the file of a ``--prompt 3`` run replaced its row:
    the case's fields (its key) held no workload."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "dp.json"
    assert dp_bench.main(DP + ["--prompt", "3", "--out", str(out)]) == 0
    assert dp_bench.main(DP + ["--prompt", "4", "--serial", "--out", str(out)]) == 0
    got = results.load(out)["rows"]
    assert sorted((r["prompt"], r["overlap"]) for r in got) == [(3, True), (4, False)]
    assert len({r["label"] for r in got}) == 2, "two workloads' rows must not read alike"
    assert all({"requests_per_rank", "prompt", "output", "max_batch", "overlap"}
               <= set(r["case_key"]) for r in got)


def test_the_suite_s_dp_cases_carry_their_profile_s_workload():
    for profile, workload in profiles.DP_WORKLOAD.items():
        for case in profiles.dp_cases(profile):
            assert case.key() | workload == case.key() and case.key()["overlap"] is True


def test_the_committed_dp_rows_read_with_the_workload_they_ran():
    """Rows written before the workload was their key: the run's recorded workload (a
    skipped row, which ran nothing, takes its run's), served serially (before 6a1e698)."""
    data = results.load(COMMITTED_DP)
    assert len(data["rows"]) == 16
    for r in data["rows"]:
        assert (r["requests_per_rank"], r["prompt"], r["output"], r["max_batch"],
                r["overlap"]) == (64, 128, 64, 32, False), r["label"]
        assert {"prompt", "overlap"} <= set(r["case_key"])
        assert r["label"].endswith(" serial"), r["label"]  # an overlapped run's reads apart
    rows_, runs = results.rows_of([COMMITTED_DP])
    assert "DP scaling" in report.build(rows_, runs)


def test_an_overlapped_run_keeps_the_committed_serial_rows(tmp_path):
    path = tmp_path / "dp.json"
    shutil.copy(COMMITTED_DP, path)
    old = results.load(path)
    run = next(iter(old["runs"].values()))
    row = next(r for r in old["rows"] if r["verification"]["status"] == "verified")
    later = run | {"run_id": "20270101-000000-abc"}
    fresh = {k: v for k, v in row.items() if k != "run_id"}
    results.upsert(path, later, [fresh | {"overlap": True}])
    assert len(results.load(path)["rows"]) == 17, "another axis: the serial row stays"
    results.upsert(path, later | {"run_id": "20270102-000000-abc"}, [fresh])
    assert len(results.load(path)["rows"]) == 17, "the same workload replaces its row"


def test_dp_rows_of_two_workloads_are_drawn_apart():
    dp = [r for r in rows() if r["suite"] == "dp"]
    serial = [r | {"overlap": False, "derived": {**r["derived"], "output_tokens_per_s": 1.0}}
              for r in dp]
    [fig, *_] = report_charts.dp(dp + serial)
    names = [t.name for t in fig.data]
    assert len(names) == len(set(names)) == 4 and any("overlap=False" in n for n in names)


class _Clock:
    """``datetime`` as provenance uses it, its ``now`` fixed."""
    UTC = datetime.UTC

    def __init__(self, now):
        self.datetime = type("D", (), {"now": staticmethod(lambda tz=None: now)})


def test_two_runs_started_in_one_second_get_different_ids(monkeypatch):
    monkeypatch.setenv("MULTILORA_GIT_SHA", "a" * 40)
    t = datetime.datetime(2027, 1, 2, 3, 4, 5, 100, tzinfo=datetime.UTC)
    monkeypatch.setattr(provenance, "datetime", _Clock(t))
    cpu = torch.device("cpu")
    a, b = provenance.collect(cpu)["run_id"], provenance.collect(cpu)["run_id"]
    assert a != b, "one id for two runs: their rows are indistinguishable"
    assert a.startswith("20270102-030405") and "aaaaaaaaaa" in a
    monkeypatch.setattr(provenance, "datetime", _Clock(t.replace(microsecond=900)))
    later = provenance.collect(cpu)["run_id"]
    assert later > a, "the later run of the second is the latest (latest_per_case)"
    assert later > "20270102-030405-" + "a" * 10  # an id of the old format, that second


def _torch_backend(r: dict, scale: float) -> dict:
    stats = r["stats"] and {**r["stats"], "median_us": r["stats"]["median_us"] * scale}
    return r | {"backend": "torch", "stats": stats}


def test_the_model_table_keeps_backends_apart():
    model = [r for r in rows() if r["suite"] == "model"]
    both = model + [_torch_backend(r, 2.0) for r in model]
    _, one = table.model_cells(model)
    _, two = table.model_cells(both)
    assert len(two) == 2 * len(one), "a torch line replaced the triton line"
    names = {line[0] for line in two}
    assert any("triton" in n for n in names) and any("torch" in n for n in names)
    # One backend: its name stays as it was.
    assert not any("triton" in line[0] for line in one)


@pytest.mark.parametrize("chart", [report_charts.model_graph_vs_eager,
                                   report_charts.model_lora_cost])
def test_the_model_charts_keep_backends_apart(chart):
    model = [r for r in rows() if r["suite"] == "model"]
    one = chart(model)
    two = chart(model + [_torch_backend(r, 2.0) for r in model])
    assert len(two) == 2 * len(one)
    assert sum("torch" in f.layout.title.text for f in two) == len(one)


def test_the_report_builds_with_rows_of_both_backends():
    model = [r for r in rows() if r["suite"] == "model"]
    page = report.build(model + [_torch_backend(r, 2.0) for r in model], {RUN["run_id"]: RUN})
    assert "torch" in page and json.dumps("triton")[1:-1] in page


def test_a_dp_label_names_the_workload_where_it_is_not_the_gpu_profile_s():
    gpu, cpu = profiles.dp_cases("gpu")[0], profiles.dp_cases("cpu")[0]
    assert gpu.label == "dp size=1 balanced llama3-8b L=4 no-lora"
    assert cpu.label.endswith(" req/rank=2 prompt=6 out=3 batch=2"), cpu.label
    serial = dataclasses.replace(gpu, overlap=False, output=8)
    assert serial.label == gpu.label + " out=8 serial"
