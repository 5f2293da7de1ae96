"""``python -m bench``: runs the suites of a profile case by case, verifying each case before
timing it, and writes one JSON file per suite into a run folder, a summary table at the end
and an HTML report (``report.html``) next to the results.

Where results go: a fresh, git-ignored run folder ``results/runs/<YYYYmmdd-HHMMSS>-<device>/``
(or ``--out DIR``); the committed reference files ``results/<suite>-<device>.json`` only with
``--publish``.

Examples:
  python -m bench --list                                  # the cases of this machine's profile
  python -m bench --profile gpu-quick                     # a GPU smoke run (about two minutes)
  python -m bench --suite kernels --filter 'gate_up_proj T=2048 '
  python -m bench --profile cpu --suite model --filter 'bs=1 '
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

import kernels  # noqa: F401  (selects the Triton interpreter on CPU before kernels load)
from bench import case as case_mod
from bench import hardware, provenance, results, table, timing
from bench.args import nonempty_path
from bench.context import Context
from bench.profiles import PROFILES
from bench.progress import Progress
from bench.suites import SUITES
from bench.telemetry import Telemetry
from kernels.config import interpreted
from lora_runtime.nvtx import nvtx_range

RESULTS = provenance.ROOT / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # extend: a second --suite adds its suites (it replaced the first flag's, silently).
    p.add_argument("--suite", nargs="+", action="extend", choices=(*SUITES, "all"),
                   default=None, help="suites to run (default: all; the flag may be repeated): "
                   + "; ".join(f"{s.name}: {s.summary}" for s in SUITES.values()))
    p.add_argument("--profile", choices=("auto", *PROFILES), default="auto",
                   help="auto: gpu when CUDA is available, else cpu. " + "; ".join(
                       f"{p.name}: {p.summary}" for p in PROFILES.values()))
    # append: a second --filter kept only the last one's cases, silently.
    p.add_argument("--filter", action="append", default=None, metavar="REGEX",
                   help="run the cases whose label matches (re.search), in every suite; "
                        "labels as printed by --list, e.g. 'kernels qkv_proj T=16 adapters=8 "
                        "r=16' or 'model decode llama3-8b L=4 ctx=256 bs=8 adapters=4 r=16'; "
                        "repeated: the cases matching any")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument("--out", type=nonempty_path, default=None, metavar="DIR",
                   help="folder for this run's result files and report (default: a new "
                        "results/runs/<YYYYmmdd-HHMMSS>-<device>/, git-ignored)")
    p.add_argument("--publish", action="store_true",
                   help="also upsert the rows into the committed reference files "
                        "results/<suite>-<device>.json")
    p.add_argument("--no-report", action="store_true", help="skip report.html")
    p.add_argument("--profiled-by", default=None, help=argparse.SUPPRESS)  # bench.profile's
    args = p.parse_args(argv)
    args.filter = _any_of(args.filter or [])
    return args


def _any_of(patterns: list[str]) -> str:
    """One regex matching what any of ``patterns`` matches (each checked alone first, so an
    invalid one is named as given)."""
    for pattern in patterns:
        case_mod.select([], pattern)
    return patterns[0] if len(patterns) == 1 else "|".join(map(_scoped, patterns))


_GLOBAL_FLAGS = re.compile(r"\(\?([aiLmsux]+)\)")


def _scoped(pattern: str) -> str:
    """``pattern`` as a group whose flags are its leading global ones (``(?i)``): past the
    start of the joined regex, a global flag is an error."""
    flags = ""
    while m := _GLOBAL_FLAGS.match(pattern):
        flags, pattern = flags + m[1], pattern[m.end():]
    end = "\n" if "x" in flags else ""  # verbose: a comment would swallow the ")"
    return f"(?{flags}:{pattern}{end})"


def select(args, profile: str) -> dict[str, list]:
    suites = args.suite or ["all"]
    names = list(SUITES) if "all" in suites else list(dict.fromkeys(suites))
    every = {n: SUITES[n].cases(profile) for n in names}
    chosen = {n: case_mod.select(c, args.filter) for n, c in every.items()}
    if not any(chosen.values()):
        labels = [c.label for cs in every.values() for c in cs]
        shown = "\n  ".join(labels[:30]) + (f"\n  ... ({len(labels) - 30} more: --list)"
                                            if len(labels) > 30 else "")
        raise SystemExit(f"--filter {args.filter!r} matches no case of suites {names} in "
                         f"profile {profile!r}. Available labels:\n  {shown}")
    return {n: c for n, c in chosen.items() if c}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    profile = args.profile if args.profile != "auto" else ("gpu" if cuda else "cpu")
    todo = select(args, profile)
    if args.list:  # listing a GPU profile's labels needs no GPU (filters for a GPU run)
        for name, cases in todo.items():
            print(f"# {name}: {len(cases)} cases (profile {profile})")
            print("\n".join(c.label for c in cases))
        return 0
    if PROFILES[profile].cuda and not cuda:
        raise SystemExit(f"profile {profile!r} needs a CUDA device; use --profile cpu")
    if not PROFILES[profile].cuda and cuda and not interpreted():
        # Triton would compile the CPU profile's kernels for the GPU and DP ranks take NCCL.
        raise SystemExit(f"profile {profile!r} runs on the CPU: on a machine with a GPU, run "
                         "it as python -m bench --profile cpu (which hides the GPUs) or set "
                         "CUDA_VISIBLE_DEVICES='' TRITON_INTERPRET=1 before starting Python")
    device = torch.device("cuda" if PROFILES[profile].cuda else "cpu")
    command = ["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)]
    run = provenance.collect(device, command) | {"profile": profile, "suite_seconds": {}}
    if args.profiled_by:  # timed under a profiler: the report never prefers these rows
        run["profiled_by"] = args.profiled_by
    slug = provenance.device_slug(device)
    out = args.out or RESULTS / "runs" / f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{slug}"
    files = [f"{name}-{slug}.json" for name in todo]
    if not args.publish and out.resolve() == RESULTS.resolve():
        raise SystemExit(f"--out {out} is the committed results folder, whose files change "
                         "only with --publish: add --publish, or give another folder")
    prepare_out(out, files, RESULTS if args.publish else None)
    ceil = hardware.measure(device, PROFILES[profile].dtype)
    run["ceilings"] = ceil.as_dict()
    tele = Telemetry.open(device)
    print(f"device: {ceil.device_name}  copy {ceil.copy_gbps:.0f} GB/s  matmul "
          f"{ceil.matmul_tflops:.1f} TFLOP/s  profile {profile}  results: {out}")
    if not tele.available:
        print(f"telemetry: off ({tele.reason}); rows carry telemetry: null")
    if device.type == "cpu":
        print(timing.CPU_NOTE)
    ctx = Context(device, ceil, PROFILES[profile].reps, profile, tele)
    summary = []
    for name, cases in todo.items():
        rows = run_suite(name, cases, ctx, tele, run, out, slug, args.publish)
        print(f"\n{name}:\n{SUITES[name].table(rows)}")
        bad = table.failures(rows)
        if bad:
            print(bad)
        summary.append(_summary_line(name, cases, rows, run["suite_seconds"][name]))
    print("\n" + "\n".join(summary))
    if not args.no_report:
        _report(out)
    return 1 if any(r.startswith("!") for r in summary) else 0


def prepare_out(out: Path, files: list[str], published: Path | None) -> None:
    """Before anything is measured: ``out`` is (made) a writable folder, and the result files
    this run will upsert into, there and in ``published``, are readable result files."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is a file, not a folder: give a folder (it is created "
                         "when missing)")
    # Checked before the folder is made: a refused run leaves no empty run folder behind.
    for path in [out / f for f in files] + [published / f for f in files if published]:
        if path.exists():
            try:
                results.load(path)
            except results.ResultFileError as e:
                raise SystemExit(f"error: {e} (this run would add its rows to it)") from None
    if published and not (published.is_dir() and os.access(published, os.W_OK | os.X_OK)):
        # It failed after the first case, leaving a run folder of one case.
        raise SystemExit(f"--publish: {published} is not a writable folder: make it writable "
                         "or run without --publish")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot create the folder ({e.strerror}): give a "
                         "writable folder") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SystemExit(f"--out {out}: the folder is not writable: give a writable folder")


def run_suite(name, cases, ctx, tele, run, out, slug, publish) -> list[dict]:
    path = out / f"{name}-{slug}.json"
    run_case = SUITES[name].start(cases, ctx)
    bar = Progress(len(cases), name)
    rows = []
    t0 = time.perf_counter()
    for case in cases:
        bar.start(case.label)
        with tele.span() as rec, nvtx_range(case.label):
            try:
                new = run_case(case)
            except Exception as e:  # noqa: BLE001  a case that raises is failed, not lost
                tail = "".join(traceback.format_exception_only(e)).strip()[-2000:]
                new = [results.make_row(case, ctx.profile, {}, verification={
                    "status": "failed", "error": f"{case.label}: the case raised: {tail}"})]
        for r in new:
            r["telemetry"] = rec or None
        run["suite_seconds"][name] = time.perf_counter() - t0
        # Written case by case: a run cut short keeps what it finished.
        results.upsert(path, run, new)
        if publish:
            results.upsert(RESULTS / path.name, run, new)
        if any(r["verification"]["status"] == "failed" for r in new):
            bar.write(f"FAILED verification: {case.label}")
        for r in new:
            if r["verification"]["status"] == "skipped":
                bar.write(f"SKIPPED {case.label}: {r['verification']['error']}")
        rows += new
        bar.finish()
    bar.close()
    return rows


def _summary_line(name, cases, rows, seconds) -> str:
    worst = {"failed": 2, "skipped": 1}  # a case is failed if any of its rows is
    status = {}
    for r in rows:
        s = r["verification"]["status"]
        if worst.get(s, 0) >= worst.get(status.get(r["label"]), 0):
            status[r["label"]] = s
    failed = sum(s == "failed" for s in status.values())
    skipped = sum(s == "skipped" for s in status.values())
    mark = "!" if failed else " "
    return (f"{mark} {name}: {len(cases)} cases, {len(cases) - failed - skipped} verified, "
            f"{failed} failed, {skipped} skipped, {seconds:.1f} s")


def _report(out: Path) -> None:
    try:
        from bench import report
    except ImportError as e:  # plotly missing (optional on a GPU image)
        print(f"no report: {e} (pip install plotly, then python -m bench.report {out})")
        return
    html = out / "report.html"
    try:
        report.write_report([out], [], html)
    except (results.ResultFileError, report.UnwritablePage) as e:
        print(f"no report: {e}")
        return
    print(f"report: {html}", file=sys.stdout)
