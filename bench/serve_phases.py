"""``python -m bench.serve_phases``: where a serving step's time goes, LoRA runtime against a
runtime without LoRA on the throughput suite's workload. Both runtimes serve the workload
(warm-up, one untimed pass), then alternate: a plain pass (its wall time) and an instrumented
pass whose phases are bounded by device syncs, so each phase's figure holds its host time and
any device work it enqueued. The table gives each phase's ms a step, per step mode (decode,
extend), base / LoRA / their difference, and the difference over the whole pass.

    python -m bench.serve_phases --adapters 16 --popularity uniform --passes 4

The syncs add ~10-20 us a phase on a GPU, so the phases of a step add up to more than a plain
step; the plain passes' walls are the throughput. Phases: ``schedule``, ``build`` (the batch,
on the device), ``forward`` (what follows, to the logits), inside it ``lora plan+layouts``
(``LoRAManager.prepare_for_replay``) and its ``lora plan``, ``buffer write`` (the graph's static
inputs) and ``replay`` (the graph launch, to its end); then ``sample``."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys
import time
import types

import torch

from bench import throughput_bench
from bench.args import positive, torch_device
from bench.profiles import throughput_cases
from bench.table import render
from bench.timing import CPU_NOTE
from graphs import replayable, static_batch
from lora_runtime.engine import engine as engine_module
from lora_runtime.engine import scheduler as scheduler_module
from lora_runtime.engine.workload import WorkloadSpec, make_workload, serve
from lora_runtime.lora import manager as manager_module

PHASES = (  # (owner, method, phase)
    (engine_module.Engine, "step", "step"),
    (scheduler_module.Scheduler, "schedule", "schedule"),
    (engine_module.Engine, "_build", "build"),
    (engine_module.Engine, "forward", "forward"),
    (manager_module.LoRAManager, "prepare_for_replay", "lora plan+layouts"),
    (manager_module.LoRAManager, "plan_lora_batch", "lora plan"),
    (static_batch.DecodeBuffers, "write", "buffer write"),
    (static_batch.PrefillBuffers, "write", "buffer write"),
    (replayable.CudaGraph, "replay", "replay"),
    (replayable.TracedGraph, "replay", "replay"),
    (engine_module.Engine, "_sample", "sample"),
)
ROWS = ("step", "schedule", "build", "forward", "lora plan+layouts", "lora plan", "buffer write",
        "replay", "sample")


@contextlib.contextmanager
def instrumented(device: torch.device):
    """Wraps every phase's method with device syncs and a timer while the block runs; yields
    the seconds per (step mode, phase) and the steps per mode. The methods are restored on
    exit, whatever happens."""
    seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
    steps: collections.Counter = collections.Counter()
    mode = [None]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def wrap(fn, phase: str):
        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            if phase == "schedule" and out is not None:
                mode[0] = out.mode.value
                steps[mode[0]] += 1
            seconds[(mode[0], phase)] += time.perf_counter() - t0
            return out
        return timed

    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in PHASES]
    try:
        for owner, name, phase in PHASES:
            setattr(owner, name, wrap(owner.__dict__[name], phase))
        yield seconds, steps
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def case_and_spec(adapters: int, popularity: str, device: torch.device):
    """The profile's first throughput case with this adapter count and popularity, and its
    workload (``ValueError`` naming the argument where they do not go together)."""
    base_case = throughput_cases("gpu" if device.type == "cuda" else "cpu")[0]
    case = dataclasses.replace(base_case, adapters=adapters, popularity=popularity,
                               ranks=base_case.ranks if adapters == 0 else "16")
    prompt, output = (int(x) for x in case.workload.removeprefix("in").split("-out"))
    return case, WorkloadSpec(case.requests, prompt, output, popularity=popularity,
                              num_adapters=adapters, seed=1)


def run(adapters: int, popularity: str, passes: int, device: torch.device) -> dict:
    """Per step mode and phase, ms a step for each runtime; the plain passes' walls."""
    case, spec = case_and_spec(adapters, popularity, device)
    ctx = types.SimpleNamespace(device=device, telemetry=None)
    runtimes = {"lora": throughput_bench._Runtime(case, ctx, spec, adapters),
                "base": throughput_bench._Runtime(case, ctx, spec, 0)}
    workload = make_workload(spec, runtimes["lora"].config.vocab_size)
    workloads = {"lora": workload,
                 "base": [dataclasses.replace(w, adapter=None) for w in workload]}

    def serve_once(key: str) -> None:
        rt = runtimes[key]
        serve(engine_module.Engine(rt.runner, rt.sched, rt.graphs), workloads[key])

    for key in runtimes:
        serve_once(key)  # untimed
    walls = {k: [] for k in runtimes}
    phase_ms = {k: collections.defaultdict(float) for k in runtimes}
    steps = {k: collections.Counter() for k in runtimes}
    for _ in range(passes):
        for key in ("base", "lora"):
            _sync(device)
            t0 = time.perf_counter()
            serve_once(key)
            _sync(device)
            walls[key].append(time.perf_counter() - t0)
            with instrumented(device) as (seconds, counts):
                serve_once(key)
            for k, v in seconds.items():
                phase_ms[key][k] += 1e3 * v / passes
            steps[key] = counts
    for rt in runtimes.values():
        rt.release()
    pct = 100 * statistics.median(walls["base"]) / statistics.median(walls["lora"])
    return {"case": case.label, "walls_s": walls, "phase_ms": phase_ms, "steps": steps,
            "pct_of_base": pct}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(result: dict) -> str:
    out = []
    for mode in ("decode", "extend"):
        n = {k: max(result["steps"][k][mode], 1) for k in ("base", "lora")}
        rows = []
        for phase in ROWS:
            b = result["phase_ms"]["base"].get((mode, phase), 0.0)
            lo = result["phase_ms"]["lora"].get((mode, phase), 0.0)
            rows.append([phase, f"{b / n['base']:.3f}", f"{lo / n['lora']:.3f}",
                         f"{lo / n['lora'] - b / n['base']:+.3f}", f"{lo - b:+.2f}"])
        out.append(f"{mode}: {result['steps']['base'][mode]} steps a pass (base), "
                   f"{result['steps']['lora'][mode]} (LoRA)")
        out.append(render(["phase", "base ms/step", "LoRA ms/step", "LoRA - base",
                           "pass total, ms"], rows))
    walls = {k: ", ".join(f"{1e3 * w:.1f}" for w in v) for k, v in result["walls_s"].items()}
    out.append(f"plain passes, ms: base {walls['base']}; LoRA {walls['lora']}; LoRA at "
               f"{result['pct_of_base']:.1f}% of base (median walls)")
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=positive, default=16)
    p.add_argument("--popularity", default="uniform",
                   choices=["identical", "uniform", "zipf", "distinct"])
    p.add_argument("--passes", type=positive, default=4)
    p.add_argument("--device", type=torch_device,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    try:
        case_and_spec(a.adapters, a.popularity, a.device)
    except ValueError as e:
        p.error(f"--adapters {a.adapters} --popularity {a.popularity}: {e}")
    if torch.device(a.device).type == "cpu":
        print(CPU_NOTE, file=sys.stderr)
    result = run(a.adapters, a.popularity, a.passes, a.device)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
