"""``python -m bench.host`` end to end at tiny sizes: every host-path benchmark runs and passes
its checks, the run is saved under its device's name, and a first run passes with nothing to
compare with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    for bench in ("build_batch", "lora_prepare_eager", "input_buffer_refresh",
                  "graph_step_host"):
        assert {f"test_{bench}[cpu-bs1]", f"test_{bench}[cpu-bs4]"} <= names
    assert {f"test_lora_plan[cpu-bs{bs}-{kind}]" for bs in (1, 4)
            for kind in ("planned", "cache_hit")} <= names
    assert {f"test_lora_buffer_refresh[cpu-bs{bs}-{batch}]" for bs in (1, 4)
            for batch in ("changed", "unchanged")} <= names


class _Rounds:
    """A stand-in for pytest-benchmark's fixture: each round its setup, then one timed call,
    counted by whether the manager planned (the cached plan path acquires no slots)."""

    def __init__(self, world):
        self.world, self.extra_info, self.planned = world, {}, []

    def pedantic(self, fn, args=(), setup=None, rounds=3, **_):
        acquired = []
        real = self.world.lora._acquire
        self.world.lora._acquire = lambda used: (acquired.append(1), real(used))[1]
        try:
            for _ in range(3):
                if setup is not None:
                    setup()
                before = len(acquired)
                out = fn(*args)
                self.planned.append(len(acquired) > before)
        finally:
            del self.world.lora._acquire
        return out

    def __call__(self, fn, *args):
        return self.pedantic(fn, args)


def test_the_plan_benchmark_plans_each_round_and_the_cache_hit_is_timed_apart():
    import torch

    from bench.host import test_host_path as host
    from bench.host.world import HostShape, HostWorld

    world = HostWorld(HostShape((2,), 2, 8, 8, 1, ("o_proj",)), torch.device("cpu")).reset()
    for cached, want in ((False, [True] * 3), (True, [False] * 3)):
        bench = _Rounds(world)
        host.test_lora_plan(bench, world, 2, cached)
        assert bench.planned == want
        world.reset()


BAD_OPTIONS = [("--host-batch-sizes", "1,x"), ("--host-batch-sizes", "0"), ("--host-threads", "0"),
               ("--host-devices", "gpu"), ("--host-targets", "foo"), ("--host-context", "0")]


@pytest.fixture(scope="module")
def bad_option_runs(tmp_path_factory):
    """Every bad option's run, started together: each is mostly Python's and torch's start-up,
    so on a small CI machine they overlap instead of queueing one after another."""
    started = {}
    for option in BAD_OPTIONS:
        out = tmp_path_factory.mktemp("bad-option")
        cmd = [sys.executable, "-m", "bench.host", "--out", str(out), "-p", "no:cacheprovider",
               *option]
        started[option] = (out, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True))
    runs = {}
    try:
        for option, (out, p) in started.items():
            text, _ = p.communicate(timeout=180)
            runs[option] = (p.returncode, text, out)
    finally:
        for _, p in started.values():
            p.kill()
    return runs


@pytest.mark.parametrize("option", BAD_OPTIONS)
def test_a_bad_host_option_is_one_usage_error_naming_it(bad_option_runs, option):
    """Each was a collection traceback, an INTERNALERROR or an error in every test's set-up,
    none naming the flag; no run file is kept."""
    returncode, out, folder = bad_option_runs[option]
    flag = option[0]
    assert returncode == 4, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and flag in errors[0], out[-3000:]
    assert "Traceback" not in out and "INTERNALERROR" not in out
    assert not list(folder.glob("*.json"))
