"""Compares a host-path benchmark run (a pytest-benchmark JSON file) with an earlier one: each
benchmark's median before and now, their ratio, and a regression where it grew past a factor.

    python -m bench.host.compare NEW.json [OLD.json] [--threshold 1.5] [--stat median]

Without OLD: the newest earlier run beside NEW of the same device and the same set-up (batch
sizes, adapters, rank, context, targets, devices, threads), whatever subset of the benchmarks
it ran; run files are named ``<YYYYmmdd-HHMMSS>-<device>.json``. When there is none, it says
so and passes. Exit status: 0 passed, 1 a regression."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.args import existing_file
from bench.table import fmt, render

RUN_NAME = re.compile(r"^(?P<stamp>\d{8}-\d{6})-(?P<device>.+)\.json$")
DEFAULT_THRESHOLD = 1.5
REGRESSION, FASTER, NEW, GONE = "REGRESSION", "faster", "new", "not run"


@dataclass(frozen=True)
class Change:
    name: str
    old_us: float | None
    new_us: float | None

    @property
    def ratio(self) -> float | None:
        if self.old_us is None or self.new_us is None or self.old_us <= 0:
            return None
        return self.new_us / self.old_us

    def flag(self, threshold: float) -> str:
        if self.old_us is None:
            return NEW
        if self.new_us is None:
            return GONE
        r = self.ratio
        if r is None:
            return ""
        if r > threshold:
            return REGRESSION
        return FASTER if r < 1 / threshold else ""


def read_times(path: Path, stat: str = "median") -> dict[str, float]:
    """Benchmark name -> its ``stat`` in microseconds."""
    data = json.loads(Path(path).read_text())
    return {b["name"]: b["stats"][stat] * 1e6 for b in data.get("benchmarks", [])}


def run_file(text: str) -> Path:
    """An argparse ``type``: a run file of ``python -m bench.host`` (pytest-benchmark JSON),
    checked before the run: another file compared as a run of no benchmarks and passed."""
    path = existing_file(text)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text}: not valid JSON ({e}); the file is truncated "
                                         "or corrupt") from None
    benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
    if not isinstance(benchmarks, list) or not all(
            isinstance(b, dict) and "name" in b and isinstance(b.get("stats"), dict)
            for b in benchmarks):
        raise argparse.ArgumentTypeError(f"{text}: not a host-path benchmark run (no "
                                         "'benchmarks' list of named stats); give a run file "
                                         "of python -m bench.host, e.g. results/host-cpu.json")
    return path


def setup_of(path: Path) -> tuple:
    """What must match for two runs' times to compare: shapes and devices benchmarked."""
    run = json.loads(Path(path).read_text()).get("machine_info", {}).get("multilora", {})
    return (json.dumps(run.get("host_shape"), sort_keys=True), run.get("devices"),
            run.get("torch_threads"))


def differences(new: Path, old: Path) -> list[str]:
    """What differs between two runs' machines and set-ups ("device: cpu / NVIDIA H200")."""
    def info(path):
        run = json.loads(Path(path).read_text()).get("machine_info", {}).get("multilora", {})
        return {"device": run.get("device"), "devices": run.get("devices"),
                "set-up": json.dumps(run.get("host_shape"), sort_keys=True),
                "torch threads": run.get("torch_threads")}

    a, b = info(new), info(old)
    return [f"{k}: {a[k]} (this run) / {b[k]} (baseline)" for k in a if a[k] != b[k]]


def previous_run(new: Path) -> Path | None:
    """The newest run file beside ``new``, older than it, of the same device and set-up."""
    m = RUN_NAME.match(new.name)
    if m is None:
        raise ValueError(f"{new.name} is not named <YYYYmmdd-HHMMSS>-<device>.json; give the "
                         "earlier run to compare with explicitly")
    earlier = []
    for p in new.parent.glob(f"*-{m['device']}.json"):
        o = RUN_NAME.match(p.name)
        if o and o["device"] == m["device"] and o["stamp"] < m["stamp"]:
            earlier.append((o["stamp"], p))
    want = setup_of(new)
    return next((p for _, p in sorted(earlier, reverse=True) if setup_of(p) == want), None)


def changes(new: dict[str, float], old: dict[str, float]) -> list[Change]:
    names = list(new) + [n for n in old if n not in new]
    return [Change(n, old.get(n), new.get(n)) for n in names]


def table(rows: list[Change], threshold: float, stat: str) -> str:
    cells = [[c.name, fmt(c.old_us), fmt(c.new_us), fmt(c.ratio, ".2f"), c.flag(threshold)]
             for c in rows]
    return render(["benchmark", f"previous {stat} us", f"new {stat} us", "ratio", "flag"],
                  cells)


def compare(new_path: Path, old_path: Path | None, threshold: float = DEFAULT_THRESHOLD,
            stat: str = "median", out=None) -> int:
    """Prints the comparison; returns the exit status (1: a regression)."""
    out = out or sys.stdout
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1 (a factor on the {stat}), got {threshold}")
    if old_path is None:
        print(f"no previous run of this device and set-up beside {new_path}: nothing to "
              "compare with (passes)", file=out)
        return 0
    rows = changes(read_times(new_path, stat), read_times(old_path, stat))
    print(f"{new_path} against {old_path}:\n{table(rows, threshold, stat)}", file=out)
    apart = differences(new_path, old_path)
    if apart:  # an explicit baseline: compared as asked, but never silently across machines
        print(f"note: the two runs differ in {'; '.join(apart)}: their times are of other "
              "machines or set-ups, and the flags compare them as if they were not "
              "(compare with a run of this device and set-up, e.g. results/host-<device>.json "
              "of this machine's device)", file=out)
    bad = [c.name for c in rows if c.flag(threshold) == REGRESSION]
    if bad:
        print(f"REGRESSION: {len(bad)} benchmark(s) over {threshold}x their previous {stat}: "
              f"{', '.join(bad)}", file=out)
        return 1
    compared = sum(c.ratio is not None for c in rows)
    new = sum(c.new_us is not None for c in rows)
    if compared == 0:
        print(f"nothing compared: none of this run's {new} benchmark(s) is in {old_path} "
              "(renamed or new benchmarks: publish a new reference with `python -m bench.host "
              "--publish`)", file=out)
        return 0
    print(f"no benchmark over {threshold}x its previous {stat} ({compared} of this run's {new} "
          "compared)", file=out)
    return 0


def _factor(text: str) -> float:
    value = float(text)
    if not value > 1:  # nan too: no ratio is ever above it
        raise argparse.ArgumentTypeError(f"a factor > 1 on the previous time, got {text}")
    return value


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=_factor, default=DEFAULT_THRESHOLD,
                   help="a benchmark regresses when its time exceeds this factor of the "
                        "previous one (default %(default)s)")
    p.add_argument("--stat", choices=("median", "min", "mean"), default="median",
                   help="the statistic compared (default %(default)s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("new", type=run_file)
    p.add_argument("old", type=run_file, nargs="?", default=None,
                   help="default: the newest earlier run of the same device beside NEW")
    add_options(p)
    args = p.parse_args(argv)
    try:
        old = args.old if args.old is not None else previous_run(args.new)
        return compare(args.new, old, args.threshold, args.stat)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    raise SystemExit(main())
