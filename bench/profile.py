"""``python -m bench.profile FILTER`` (``nox -s profile -- FILTER``): one benchmark case under
a profiler. With ``nsys`` and a GPU: ``nsys profile -t cuda,nvtx`` (the case's NVTX ranges in
the "multilora" domain) and nsys's per-range kernel summary. Otherwise: a torch profiler
trace with the same range names (``trace.json``, Perfetto-compatible: open it at
ui.perfetto.dev) and a table of each range's kernels (GPU) or top-level ops (CPU)."""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before torch sees a GPU and Triton decorates a kernel
    from bench import cpu_only
    cpu_only.select(sys.argv[1:])

import argparse
import datetime
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

from bench import case as case_mod
from bench import cli, provenance, results
from bench.args import nonempty_path
from bench.profiles import PROFILES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("filter", help="a regex matching exactly one case label (see python -m "
                                  "bench --list)")
    p.add_argument("--profile", default="auto", choices=("auto", *PROFILES),
                   help="bench profile (default: auto)")
    p.add_argument("--out", type=nonempty_path, default=None, metavar="DIR")
    p.add_argument("--torch", action="store_true", help="use the torch profiler even with nsys")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.profile in PROFILES and PROFILES[args.profile].cuda and not cuda:
        raise SystemExit(f"profile {args.profile!r} needs a CUDA device; use --profile cpu")
    label = _one_case(args)
    slug = provenance.device_slug(torch.device("cuda" if cuda else "cpu"))
    out = args.out or (cli.RESULTS / "runs" /
                       f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{slug}-profile")
    cli.prepare_out(out, [], None)
    try:
        held = results.holds_results(out)
    except results.ResultFileError as e:
        raise SystemExit(f"error: {e} (--out {out})") from None
    if held:  # the profiled case's rows would replace the ones timed without a profiler
        raise SystemExit(f"--out {out}: the folder holds result files, whose rows of this case "
                         "a profiled run would replace: give a fresh folder (or leave --out "
                         "out)")
    nsys = shutil.which("nsys")
    use_nsys = bool(nsys and cuda and not args.torch)
    bench_args = ["--profile", args.profile, "--filter", case_mod.exact(label), "--out",
                  str(out), "--no-report", "--profiled-by", "nsys" if use_nsys else "torch"]
    if use_nsys:
        return _nsys(nsys, bench_args, out)
    why = "nsys is not installed" if not nsys else "no GPU" if not cuda else "--torch"
    print(f"{why}: recording a torch profiler trace instead (same range names)", flush=True)
    if label.startswith(f"{SPAWNED} "):
        print(SPAWNED_NOTE, flush=True)
    return _torch_profile(bench_args, out, cuda)


SPAWNED = "dp"
"""The suite whose cases run in spawned rank processes, which a torch profiler of this process
does not record (nsys follows them)."""
SPAWNED_NOTE = ("note: a dp case runs its model in spawned rank processes, which the torch "
                "profiler of this process does not record: the trace and the table below hold "
                "this process's work only (waiting for the ranks); nsys, on a GPU machine, "
                "records the ranks too")


def _one_case(args) -> str:
    profile = args.profile if args.profile != "auto" else (
        "gpu" if torch.cuda.is_available() else "cpu")
    ns = argparse.Namespace(suite=["all"], filter=args.filter)
    try:
        labels = [c.label for cs in cli.select(ns, profile).values() for c in cs]
    except SystemExit as e:  # select names the flag of python -m bench; here it is positional
        raise SystemExit(str(e.code).replace("--filter ", "the filter ", 1)) from None
    if len(labels) > 1:
        shown = "\n  ".join(labels[:20])
        raise SystemExit(f"{args.filter!r} matches {len(labels)} cases; profile one (anchor it "
                         f"with ^...$):\n  {shown}")
    return labels[0]


def _nsys(nsys: str, bench_args: list[str], out: Path) -> int:
    rep = out / "profile"
    cmd = [nsys, "profile", "-t", "cuda,nvtx", "--force-overwrite=true", "-o", str(rep),
           sys.executable, "-m", "bench", *bench_args]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0 and not Path(f"{rep}.nsys-rep").exists():
        return rc
    if rc != 0:  # (nsys passes the run's status on) a case that failed still ran: summarise
        print(f"the profiled run exited with status {rc} (a case failed: see above); its "
              "report still holds what ran", flush=True)
    for reports in ("nvtx_kern_sum", "nvtx_sum,cuda_gpu_kern_sum"):
        stats = subprocess.run([nsys, "stats", "--report", reports, f"{rep}.nsys-rep"],
                               capture_output=True, text=True)
        if stats.returncode == 0:
            print(stats.stdout)
            (out / "ranges.txt").write_text(stats.stdout)
            break
    else:  # the summary was left out without a word
        why = (stats.stderr or stats.stdout).strip()[-1000:] or f"exit status {stats.returncode}"
        print(f"no per-range summary: nsys stats --report {reports} failed ({why}); the nsys "
              "report holds the ranges: open it in Nsight Systems or run nsys stats on it",
              flush=True)
    print(f"nsys report: {rep}.nsys-rep (open in Nsight Systems)")
    return rc


def _torch_profile(bench_args: list[str], out: Path, cuda: bool) -> int:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        rc = cli.main(bench_args)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    text = range_table(prof.events(), cuda)
    print(text)
    (out / "ranges.txt").write_text(text + "\n")
    print(f"trace: {trace} (Perfetto-compatible: ui.perfetto.dev or chrome://tracing)")
    return rc


def range_table(events, cuda: bool, top: int = 8) -> str:
    """Per NVTX-named range: its kernels (GPU: device time) or top-level ops (CPU: CPU time,
    including children), most expensive first."""
    lines = []
    ranges: dict[str, list] = {}  # path -> [occurrences, wall us, {name: [count, us]}]
    for r in events:
        if not getattr(r, "is_user_annotation", False):
            continue
        seen = ranges.setdefault(_path(r), [0, 0.0, defaultdict(lambda: [0, 0.0])])
        seen[0] += 1
        seen[1] += r.time_range.end - r.time_range.start
        for name, us in (_kernels(r) if cuda else _top_ops(r)):
            seen[2][name][0] += 1
            seen[2][name][1] += us
    # One section a range path (a case's "replay" ranges summed, not one section each).
    for path, (times, span, acc) in ranges.items():
        lines.append(f"\n{path}  ({span:.0f} us wall" + (f", {times} times)" if times > 1
                                                          else ")"))
        for name, (n, us) in sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {us:12.1f} us  {n:6d}x  {name[:100]}")
        if not acc:  # a bare heading read as a table cut off
            lines.append(f"  (no {'kernels' if cuda else 'ops'} recorded in this range in this "
                         "process)")
    kind = "kernels (device time)" if cuda else "top-level ops (CPU time incl. children)"
    return f"per-range {kind}:" + "".join("\n" + ln for ln in lines)


def _path(e) -> str:
    """The range's name under the ranges around it (``case > replay``)."""
    names, p = [e.name], getattr(e, "cpu_parent", None)
    while p is not None:
        if getattr(p, "is_user_annotation", False):
            names.append(p.name)
        p = getattr(p, "cpu_parent", None)
    return " > ".join(reversed(names))


def _descendants(e):
    for c in e.cpu_children:
        yield c
        yield from _descendants(c)


def _kernels(r):
    found = [(k.name, k.duration) for d in _descendants(r) for k in getattr(d, "kernels", [])]
    if not found:  # torch versions that list device events as children instead
        found = [(d.name, d.time_range.end - d.time_range.start) for d in _descendants(r)
                 if str(getattr(d, "device_type", "")).endswith("CUDA")]
    return found


def _top_ops(r):
    for c in r.cpu_children:
        if not getattr(c, "is_user_annotation", False):
            yield c.name, c.cpu_time_total


if __name__ == "__main__":
    sys.exit(main())
