"""``python -m bench.host`` (``nox -s hostbench``): runs the host-path benchmarks under
pytest-benchmark, saves the run as ``results/runs/host/<YYYYmmdd-HHMMSS>-<device>.json``
(git-ignored) and compares it with the previous run of the same device there, failing on a
regression (``bench/host/compare.py``). ``--baseline FILE`` compares with that file instead,
e.g. the committed reference ``results/host-<device>.json``, which only ``--publish`` writes
(refused with a selection such as ``-k``: the reference holds every benchmark).
Other arguments go to pytest: ``-k plan``, ``--host-batch-sizes 1,8``, ``--host-devices cpu``.
A run whose checks fail is not kept, so it never becomes the next run's baseline."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from bench.host import compare

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "results" / "runs" / "host"


def reference_path(slug: str) -> Path:
    return ROOT / "results" / f"host-{slug}.json"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    compare.add_options(p)
    p.add_argument("--baseline", type=compare.run_file, default=None, metavar="FILE",
                   help="compare with this run file instead of the previous run")
    p.add_argument("--publish", action="store_true",
                   help="when the comparison passes, write the run (without raw samples) to "
                        "the committed reference results/host-<device>.json")
    p.add_argument("--out", type=Path, default=RUNS, metavar="DIR",
                   help="folder of the run files (default %(default)s)")
    return p.parse_known_args(argv)


def run_benchmarks(path: Path, pytest_args: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).parent), "-q",
           f"--benchmark-json={path}", "--benchmark-group-by=func",
           "--benchmark-columns=min,median,iqr,rounds", "--benchmark-sort=name", *pytest_args]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def publish(run: Path, slug: str) -> Path:
    data = json.loads(run.read_text())
    for b in data["benchmarks"]:
        b["stats"].pop("data", None)  # raw samples stay in the run file
    ref = reference_path(slug)
    ref.write_text(json.dumps(data, indent=1) + "\n")
    return ref


SELECTING = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--sw", "--stepwise")
"""pytest options that run a subset: such a run is never the committed reference."""


def main(argv=None) -> int:
    args, pytest_args = parse_args(argv)
    subset = [a for a in pytest_args if a.split("=")[0] in SELECTING
              or (a.startswith("-k") and len(a) > 2) or "::" in a]
    if args.publish and subset:
        raise SystemExit(f"--publish with {' '.join(subset)}: the reference must hold every "
                         "benchmark, and a subset would replace it. Run without the selection "
                         "to publish, or drop --publish")
    set_up = [a.split("=")[0] for a in pytest_args if a.startswith("--host-")]
    if args.publish and set_up:
        raise SystemExit(f"--publish with {' '.join(set_up)}: the reference holds the default "
                         "set-up (batch sizes, devices, ...), and another one would replace its "
                         "rows. Run without those options to publish, or drop --publish")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out} is a file, not a folder: give a folder (it is "
                         "created when missing)")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: cannot create the folder ({e.strerror}): give a "
                         "writable folder") from None
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    # Not a run file's name until it passed: a failed run must never become a baseline.
    partial = args.out / f".{stamp}.partial.json"
    rc = run_benchmarks(partial, pytest_args)
    if rc != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        print(f"the benchmarks failed or timed nothing (pytest exit {rc}): run not kept, "
              "nothing compared")
        return rc or 1
    slug = json.loads(partial.read_text())["machine_info"]["multilora"]["device_slug"]
    run = partial.rename(args.out / f"{stamp}-{slug}.json")
    print(f"run saved: {run}")
    old = args.baseline if args.baseline is not None else compare.previous_run(run)
    rc = compare.compare(run, old, args.threshold, args.stat)
    if args.publish:
        if rc == 0:
            print(f"published: {publish(run, slug)}")
        else:
            print("not published: the run regressed")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
