"""Comparing host-path benchmark runs: a time past the threshold is a regression (exit 1), an
equal run passes, no earlier run passes and says so, and the previous run is the newest older
one of the same device and set-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.host import compare

SHAPE = {"batch_sizes": [1, 64], "adapters": 16, "rank": 16, "context": 256, "layers": 1}


def _run(folder: Path, name: str, medians_us: dict[str, float], shape=SHAPE) -> Path:
    path = folder / name
    path.write_text(json.dumps({
        "machine_info": {"multilora": {"host_shape": shape, "devices": ["cpu"]}},
        "benchmarks": [{"name": n, "stats": {"median": us * 1e-6, "min": us * 1e-6,
                                             "mean": us * 1e-6}}
                       for n, us in medians_us.items()],
    }))
    return path


def test_a_slower_median_past_the_threshold_is_a_regression(tmp_path, capsys):
    old = _run(tmp_path, "20250101-120000-cpu.json", {"plan[bs1]": 10.0, "build[bs1]": 100.0})
    new = _run(tmp_path, "20250102-120000-cpu.json", {"plan[bs1]": 16.0, "build[bs1]": 140.0})
    assert compare.main([str(new), str(old)]) == 1
    out = capsys.readouterr().out
    assert "plan[bs1]" in out.split("REGRESSION:")[-1]
    assert "build[bs1]" not in out.split("REGRESSION:")[-1]  # 1.4x stays under 1.5x
    assert compare.main([str(new), str(old), "--threshold", "1.7"]) == 0


def test_an_equal_run_passes_and_prints_each_benchmark(tmp_path, capsys):
    times = {"plan[bs1]": 10.0, "refresh[bs64]": 50.0}
    old = _run(tmp_path, "20250101-120000-cpu.json", times)
    new = _run(tmp_path, "20250102-120000-cpu.json", times | {"step[bs1]": 5.0})
    assert compare.main([str(new)]) == 0
    out = capsys.readouterr().out
    assert str(old) in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[3:] if line}
    assert rows["plan[bs1]"] == ["10.0", "10.0", "1.00"]
    assert rows["step[bs1]"][-1] == compare.NEW


def test_no_previous_run_passes_and_says_so(tmp_path, capsys):
    new = _run(tmp_path, "20250102-120000-cpu.json", {"plan[bs1]": 10.0})
    _run(tmp_path, "20250101-120000-nvidia-h200.json", {"plan[bs1]": 1.0})  # another device
    _run(tmp_path, "20250101-110000-cpu.json", {"plan[bs1]": 1.0}, SHAPE | {"context": 8})
    assert compare.main([str(new)]) == 0
    assert "no previous run" in capsys.readouterr().out


def test_the_previous_run_is_the_newest_older_one_of_the_device_and_set_up(tmp_path):
    older = _run(tmp_path, "20250101-100000-cpu.json", {})
    _run(tmp_path, "20250101-110000-cpu.json", {}, SHAPE | {"adapters": 4})
    _run(tmp_path, "20250101-120000-nvidia-h200.json", {})
    new = _run(tmp_path, "20250102-120000-cpu.json", {})
    _run(tmp_path, "20250103-120000-cpu.json", {})  # newer than the run compared
    assert compare.previous_run(new) == older


def test_a_threshold_of_one_or_less_is_refused(tmp_path):
    new = _run(tmp_path, "20250102-120000-cpu.json", {})
    with pytest.raises(SystemExit):
        compare.main([str(new), "--threshold", "1"])


def test_a_nan_threshold_is_refused(tmp_path, capsys):
    """It passed the check (nan <= 1 is false), and no ratio is above nan: nothing regressed."""
    old = _run(tmp_path, "20250101-120000-cpu.json", {"plan[bs1]": 10.0})
    new = _run(tmp_path, "20250102-120000-cpu.json", {"plan[bs1]": 100.0})
    with pytest.raises(SystemExit) as e:
        compare.main([str(new), str(old), "--threshold", "nan"])
    assert e.value.code == 2 and "a factor > 1" in capsys.readouterr().err


def test_a_run_sharing_no_benchmark_with_the_reference_says_nothing_was_compared(
        tmp_path, capsys):
    old = _run(tmp_path, "20250101-120000-cpu.json", {"plan[cpu-bs1]": 10.0})
    new = _run(tmp_path, "20250102-120000-cpu.json", {"plan[cpu-bs1-planned]": 99.0})
    assert compare.main([str(new), str(old)]) == 0
    out = capsys.readouterr().out
    assert "nothing compared" in out and "--publish" in out
    assert "no benchmark over" not in out


def test_an_explicit_baseline_of_another_device_is_flagged_as_such(tmp_path, capsys):
    """The H200 host's CPU-tensor times against this VM's flagged 'regressions' of the machine,
    with no word that the two runs came from different devices."""
    old = _run(tmp_path, "20250101-120000-cpu.json", {"plan[cpu-bs1]": 10.0})
    new = _run(tmp_path, "20250102-120000-nvidia-h200.json", {"plan[cpu-bs1]": 20.0})
    info = json.loads(new.read_text())
    info["machine_info"]["multilora"].update(device="NVIDIA H200", devices=["cpu", "cuda"])
    new.write_text(json.dumps(info))
    assert compare.main([str(new), str(old)]) == 1
    note = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(note) == 1 and "device: NVIDIA H200 (this run) / None (baseline)" in note[0]
    assert "devices: ['cpu', 'cuda'] (this run) / ['cpu'] (baseline)" in note[0]
    same = _run(tmp_path, "20250103-120000-cpu.json", {"plan[cpu-bs1]": 10.0})
    assert compare.main([str(same), str(old)]) == 0
    assert "note:" not in capsys.readouterr().out
