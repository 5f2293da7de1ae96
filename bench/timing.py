"""One timing entry point. GPU: CUDA-graph replay (launch gaps removed) or CUDA events around
eager calls. CPU: wall clock. Always returns the raw per-call samples."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphs.replayable import capture_cuda_graph

CPU_NOTE = ("NOTE: CPU times are wall clock of the Triton interpreter and Python; they prove "
            "the pipeline runs end to end and mean nothing as performance figures.")


@dataclass
class Timing:
    samples_us: list[float]
    mode: str

    def quantile(self, q: float) -> float:
        """Nearest rank: the smallest sample with at least ``q`` of the samples at or below it
        (``int(q * n)`` took the next one where ``q * n`` is whole: p80 of 5 was the max)."""
        s = sorted(self.samples_us)
        return s[min(len(s) - 1, max(0, math.ceil(round(q * len(s), 9)) - 1))]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    def stats(self) -> dict:
        s = self.samples_us
        return {
            "median_us": self.median_us, "p20_us": self.quantile(0.2),
            "p80_us": self.quantile(0.8), "mean_us": statistics.fmean(s),
            "min_us": min(s), "max_us": max(s), "n": len(s), "mode": self.mode,
        }


def bench_time(
    fn: Callable[[], object],
    *,
    device: torch.device,
    mode: str = "graph",
    calls: int = 1,
    warmup: int = 3,
    reps: int = 30,
) -> Timing:
    """Time ``fn``, which performs ``calls`` logical calls (e.g. one per layer copy), and
    return microseconds per logical call. ``mode``: "graph" (``fn`` captured once into a CUDA
    graph, replays timed with events), "events" (eager calls between CUDA events; a host-bound
    call's time mixes with the queue it runs ahead of) or "latency" (wall clock of each call
    to the end of its device work: what a host-bound eager step costs its caller)."""
    # Checked on every device: a misspelt mode passed every CPU run, refused on the GPU only.
    if mode not in ("graph", "events", "latency"):
        raise ValueError(f"mode must be 'graph', 'events' or 'latency', got {mode!r}")
    if device.type != "cuda":
        return _wall(fn, calls, warmup=min(warmup, 1), reps=reps)
    if mode == "graph":
        return _graph(fn, calls, warmup, reps)
    if mode == "events":
        return _events(fn, calls, warmup, reps)
    return _wall(_synced(fn, device), calls, warmup, reps)


def bench_interleaved(fns: dict[object, Callable[[], object]], *, device: torch.device,
                      warmup: int = 3, reps: int = 30, mode: str = "latency"
                      ) -> dict[object, Timing]:
    """Each function of ``fns`` timed with their calls alternating rep by rep, in the dict's
    order: host-bound eager steps on a noisy host drift by tens of percent between runs a
    minute apart, and a device-bound bs-256 replay by ~5% between windows a second apart
    (clocks); alternating puts every function under the same drift, so the ratio of two is
    comparable where their separate times are not. ``mode`` (GPU): "latency" (wall clock of
    each call to the end of its device work) or "events" (CUDA events around each call, no
    sync between calls: the stream's time, as ``bench_time``'s "events"). CPU: wall clock."""
    if mode not in ("latency", "events"):
        raise ValueError(f"mode must be 'latency' or 'events', got {mode!r}")
    if device.type == "cuda" and mode == "events":
        return _events_interleaved(fns, warmup, reps)
    run = {k: (_synced(f, device) if device.type == "cuda" else f) for k, f in fns.items()}
    for _ in range(warmup):
        for f in run.values():
            f()
    out = {k: [] for k in run}
    for _ in range(reps):
        for k, f in run.items():
            t0 = time.perf_counter()
            f()
            out[k].append((time.perf_counter() - t0) * 1e6)
    return {k: Timing(v, "wall" if device.type != "cuda" else "interleaved") for k, v in
            out.items()}


def _events_interleaved(fns, warmup, reps) -> dict[object, Timing]:
    for _ in range(warmup):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    pairs = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            pairs[k].append((start, end))
    torch.cuda.synchronize()
    return {k: Timing([s.elapsed_time(e) * 1e3 for s, e in v], "events_interleaved")
            for k, v in pairs.items()}


def pair_ratio(num: Timing, den: Timing) -> float:
    """Median of the rep-by-rep ratios of two interleaved timings."""
    return statistics.median(a / b for a, b in zip(num.samples_us, den.samples_us, strict=True))


def pair_difference(a: Timing, b: Timing) -> float:
    """Median of the rep-by-rep differences ``a - b`` of two interleaved timings (us)."""
    return statistics.median(x - y for x, y in zip(a.samples_us, b.samples_us, strict=True))


def _synced(fn, device):
    def run():
        fn()
        torch.cuda.synchronize(device)

    return run


def _wall(fn, calls, warmup, reps) -> Timing:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return Timing(out, "wall")


def _events(fn, calls, warmup, reps) -> Timing:
    [t] = _events_interleaved({None: fn}, warmup, reps).values()
    return Timing([x / calls for x in t.samples_us], "events")


def _graph(fn, calls, warmup, reps) -> Timing:
    graph, _ = capture_cuda_graph(fn, warmup=2)
    for _ in range(warmup):
        graph.replay()
    t = _events(graph.replay, calls, 0, reps)
    del graph
    return Timing(t.samples_us, "cuda_graph")
