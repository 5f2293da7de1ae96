"""``python -m bench.host`` end to end at tiny sizes: every host-path benchmark runs and passes
its checks, the run is saved under its device's name, and a first run passes with nothing to
compare with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_host_benchmarks_run_and_save_a_run_file(tmp_path):
    cmd = [sys.executable, "-m", "bench.host", "--out", str(tmp_path),
           "--host-batch-sizes", "1,4", "--host-context", "8", "--host-adapters", "2",
           "--host-targets", "o_proj", "--host-devices", "cpu", "--benchmark-max-time=0.002",
           "-p", "no:cacheprovider"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [run] = tmp_path.glob("*-cpu.json")
    assert "no previous run" in p.stdout
    names = {b["name"] for b in json.loads(run.read_text())["benchmarks"]}
    for bench in ("build_batch", "lora_plan", "lora_prepare_eager", "input_buffer_refresh",
                  "graph_step_host"):
        assert {f"test_{bench}[cpu-bs1]", f"test_{bench}[cpu-bs4]"} <= names
    assert {f"test_lora_buffer_refresh[cpu-bs{bs}-{batch}]" for bs in (1, 4)
            for batch in ("changed", "unchanged")} <= names
