"""One timing entry point. GPU: CUDA-graph replay (launch gaps removed) or CUDA events around
eager calls. CPU: wall clock. Always returns the raw per-call samples."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    samples_us: list[float]
    mode: str

    def quantile(self, q: float) -> float:
        s = sorted(self.samples_us)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def p20_us(self) -> float:
        return self.quantile(0.2)

    @property
    def p80_us(self) -> float:
        return self.quantile(0.8)

    def summary(self) -> dict:
        return {
            "median_us": self.median_us,
            "p20_us": self.p20_us,
            "p80_us": self.p80_us,
            "samples": len(self.samples_us),
            "timing_mode": self.mode,
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
    return microseconds per logical call."""
    if device.type != "cuda":
        return _wall(fn, calls, warmup=min(warmup, 1), reps=reps)
    if mode == "graph":
        return _graph(fn, calls, warmup, reps)
    if mode == "events":
        return _events(fn, calls, warmup, reps)
    raise ValueError(f"mode must be 'graph' or 'events', got {mode!r}")


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
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return Timing([s.elapsed_time(e) * 1e3 / calls for s, e in pairs], "events")


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # Compiles Triton kernels and warms the allocator and cuBLAS outside the capture.
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _graph(fn, calls, warmup, reps) -> Timing:
    graph = capture_graph(fn)
    for _ in range(warmup):
        graph.replay()
    t = _events(graph.replay, calls, 0, reps)
    del graph
    return Timing(t.samples_us, "cuda_graph")
