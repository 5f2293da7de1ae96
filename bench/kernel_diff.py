"""Where a step's extra time goes, kernel by kernel: the torch profiler over ``reps`` calls of
each of two functions (a LoRA replay and a base replay of the same shape), their device time
per call summed by kernel name (on a CPU: self CPU time by op), and the names whose time
differs most. Kernels running on a side branch of a graph overlap the main branch: their
time as profiled is how long they ran, not what they added to the step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

NAME_CHARS = 80


def per_kernel_us(fn: Callable[[], object], reps: int, cuda: bool) -> dict[str, list[float]]:
    """``{name: [us a call, launches a call]}`` over ``reps`` calls of ``fn``."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda or (not cuda and getattr(e, "is_user_annotation", False)):
            continue
        name = e.name[:NAME_CHARS]
        out[name][0] += (e.device_time if cuda else e.self_cpu_time_total) / reps
        out[name][1] += 1 / reps
    return dict(out)


def kernel_diff(a: dict[str, list[float]], b: dict[str, list[float]],
                top: int) -> list[dict]:
    """The ``top`` names by |a - b| (us a call), each with both sides' time and launches."""
    rows = [{"name": n, "diff_us": a.get(n, [0, 0])[0] - b.get(n, [0, 0])[0],
             "a_us": a.get(n, [0, 0])[0], "b_us": b.get(n, [0, 0])[0],
             "a_launches": a.get(n, [0, 0])[1], "b_launches": b.get(n, [0, 0])[1]}
            for n in {*a, *b}]
    rows.sort(key=lambda r: (-abs(r["diff_us"]), r["name"]))
    return [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
            for r in rows[:top]]
