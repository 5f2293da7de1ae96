"""Benchmark result rows and files: keys from case fields (a new axis never overwrites other
rows), upsert by case, old files readable, reproduce filters that select exactly one case,
errors on empty selections, tables whose columns never run together, NVML telemetry math."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from report_rows import RUN, rows

from bench import case as case_mod
from bench import cli, migrate, results, table, telemetry
from bench.model_bench import ModelCase
from bench.timing import Timing, bench_time

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class _Case(case_mod.Case):
    suite = "demo"
    size: int

    @property
    def label(self) -> str:
        return f"demo size={self.size}"


@dataclass(frozen=True)
class _CaseWithAxis(_Case):
    mode: str = "new"


def _row(case, us=1.0, **variant):
    return results.make_row(case, "cpu", variant, timing=Timing([us], "wall"))


def test_upsert_replaces_a_case_and_a_new_axis_adds_rows(tmp_path):
    path = tmp_path / "demo.json"
    results.upsert(path, RUN, [_row(_Case(1), 1.0, p="a"), _row(_Case(1), 2.0, p="b"),
                               _row(_Case(2), 3.0, p="a")])
    results.upsert(path, RUN, [_row(_Case(1), 9.0, p="a")])
    got = {(r["size"], r["p"]): r["stats"]["median_us"] for r in results.load(path)["rows"]}
    assert got == {(2, "a"): 3.0, (1, "a"): 9.0}, "a re-run replaces all rows of its case only"
    results.upsert(path, RUN, [_row(_CaseWithAxis(2), 5.0, p="a")])
    got = [(r["size"], r.get("mode")) for r in results.load(path)["rows"]]
    assert sorted(got, key=str) == sorted([(1, None), (2, None), (2, "new")], key=str)


def test_a_case_skipped_here_keeps_the_rows_a_machine_that_ran_it_published(tmp_path):
    # DP 4 runs on a 4-GPU host and is skipped on a 2-GPU one: both publish to one file.
    path, later = tmp_path / "dp.json", RUN | {"run_id": "20270101-000000-def"}
    results.upsert(path, RUN, [_row(_Case(1), 4.0, p="a"), _row(_Case(2), 5.0, p="a")])
    skipped = results.make_row(_Case(1), "gpu", {}, verification={"status": "skipped",
                                                                 "error": "needs 4 GPUs"})
    results.upsert(path, later, [skipped, _row(_Case(2), 6.0, p="a")])
    got = {r["size"]: (r["verification"]["status"], r["run_id"])
           for r in results.load(path)["rows"]}
    assert got == {1: ("unverified", RUN["run_id"]), 2: ("unverified", later["run_id"])}
    assert set(results.load(path)["runs"]) == {RUN["run_id"], later["run_id"]}
    fresh = tmp_path / "fresh.json"  # nothing to keep: the skipped row is written
    results.upsert(fresh, later, [skipped])
    assert [r["verification"]["status"] for r in results.load(fresh)["rows"]] == ["skipped"]


def test_reading_one_run_from_several_suite_files_keeps_every_suites_seconds(tmp_path):
    early = RUN | {"suite_seconds": {"throughput": 38.0}}
    late = RUN | {"suite_seconds": {"throughput": 38.0, "idle": 5.0, "model": 97.0}}
    results.upsert(tmp_path / "model.json", late, [_row(_Case(1))])
    results.upsert(tmp_path / "throughput.json", early, [_row(_Case(2))])
    _, runs = results.rows_of([tmp_path / "model.json", tmp_path / "throughput.json"])
    assert runs[RUN["run_id"]]["suite_seconds"] == {"throughput": 38.0, "idle": 5.0,
                                                    "model": 97.0}


def test_reproduce_filter_selects_exactly_its_case():
    cases = [ModelCase("decode", "tiny", 2, 16, bs, a, r, "torch", torch.float32)
             for bs in (1, 16) for a, r in ((0, ()), (2, (8,)), (2, (4, 8)))]
    for c in cases:
        flt = re.search(r"--filter '(.*)'$", c.reproduce("cpu")).group(1)
        assert case_mod.select(cases, flt) == [c]


def test_empty_selection_is_an_error_naming_the_labels():
    ns = argparse.Namespace(suite=["all"], filter="no such case")
    with pytest.raises(SystemExit, match="kernels qkv_proj T=1 adapters=1 r=8"):
        cli.select(ns, "cpu")
    sel = cli.select(argparse.Namespace(suite=["all"], filter="bs=4 no-lora"), "cpu")
    assert list(sel) == ["model"], "--filter applies to the model suite too"


@pytest.mark.parametrize("name", ["kernels-nvidia-h200.json", "model-nvidia-h200.json",
                                  "kernels-cpu.json", "model-cpu.json",
                                  "model-nvidia-h100-80gb-hbm3.json",
                                  "throughput-nvidia-h100-80gb-hbm3.json"])
def test_committed_files_read_as_the_current_schema(name):
    path = ROOT / "results" / name
    if not path.exists():
        pytest.skip(f"{name} not committed")
    data = results.load(path)
    assert data["schema"] == results.SCHEMA and data["rows"]
    ids = [results.row_id(r) for r in data["rows"]]
    assert len(ids) == len(set(ids)), "migrated rows must keep distinct keys"
    for r in data["rows"]:
        assert r["stats"]["median_us"] > 0 and r["label"] and r["verification"]["status"]


def test_migration_keeps_the_lora_runtime_apart_from_the_base_runtime():
    old = json.loads((ROOT / "results" / "model-cpu.json").read_text())
    if old.get("schema", 1) != 1:
        pytest.skip("model-cpu.json already migrated")
    new = migrate.to_current(old)
    base = {r["label"] for r in new["rows"] if r["adapters"] == 0}
    lora = {r["label"] for r in new["rows"] if r["adapters"] > 0}
    assert base and lora and not base & lora


def test_tables_keep_columns_apart():
    big = rows(scale=12345.678)  # CPU-sized figures once ran together ("62435.8151348.3")
    for text, headers in ((table.kernel_table([r for r in big if r["suite"] == "kernels"]),
                           table.kernel_cells([])[0]),
                          (table.model_table([r for r in big if r["suite"] == "model"]),
                           table.MODEL_HEADERS)):
        head, rule, *body = text.splitlines()
        assert [h.strip() for h in re.split(r"  +", head.strip())] == headers
        assert body and not re.search(r"\d\.\d+\.\d", text)
        starts = [m.start() for m in re.finditer(r"-+", rule)]
        for line in body:
            for a in starts[1:]:
                assert line[a - 2 : a] == "  ", f"columns touch at {a}: {line!r}"


def test_the_model_table_shows_a_selection_of_runtimes_without_lora():
    # `--suite model --filter no-lora` timed its cases and printed a table of headers only.
    base = [r for r in rows() if r["suite"] == "model" and r["adapters"] == 0]
    assert base
    head, rule, *body = table.model_table(base).splitlines()
    sizes = sorted({(r["step"], r["batch_size"]) for r in base})
    assert len(body) == len(sizes)
    for line in body:
        cells = re.split(r"  +", line.strip())
        assert cells[2:4] == ["0", "-"]  # no adapters; the LoRA runtime's columns empty
        assert cells[4] != "-" and cells[5] != "-" and cells[6] == cells[7] == "-"


def test_cpu_timing_returns_raw_samples():
    t = bench_time(lambda: sum(range(100)), device=torch.device("cpu"), reps=7)
    s = t.stats()
    assert s["n"] == 7 == len(t.samples_us) and s["min_us"] <= s["median_us"] <= s["max_us"]


class _FakeNVML:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self):
        self.energy = 1_000_000

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlSystemGetDriverVersion(self):
        return "580.0"

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == 1 else 3201

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 | 0x20

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy += 5_000  # 5 J between reads
        return self.energy

    def nvmlDeviceGetMemoryInfo(self, h):
        raise RuntimeError("not supported")

    def nvmlDeviceGetTemperature(self, h, kind):
        return 55


def test_telemetry_records_clocks_throttle_and_energy(monkeypatch):
    monkeypatch.setattr(telemetry, "pynvml", _FakeNVML())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    tele = telemetry.Telemetry(handle=object())
    with tele.span() as rec:
        pass
    assert rec["device"] == "Fake GPU" and rec["energy_j"] == pytest.approx(5.0)
    snap = rec["after"]
    assert snap["sm_clock_mhz"] == 1980 and snap["power_w"] == 350.0
    assert snap["throttle"] == ["sw_power_cap", "sw_thermal"]
    assert snap["memory_used_bytes"] is None, "an unsupported field is None, not an error"


def test_telemetry_off_without_a_gpu():
    tele = telemetry.Telemetry.open(torch.device("cpu"))
    assert not tele.available and tele.reason
    with tele.span() as rec:
        pass
    assert rec == {}


def test_quantiles_are_nearest_rank():
    from bench.timing import Timing

    five = Timing([5.0, 1.0, 4.0, 2.0, 3.0], "wall").stats()
    assert (five["p20_us"], five["p80_us"], five["median_us"]) == (1.0, 4.0, 3.0)
    ten = Timing([float(i) for i in range(1, 11)], "wall")
    assert (ten.quantile(0.2), ten.quantile(0.8), ten.quantile(0.85)) == (2.0, 8.0, 9.0)
    one = Timing([7.0], "wall")
    assert one.quantile(0.2) == one.quantile(0.8) == 7.0
