"""Decode step time of the whole model: eager vs CUDA graph, with and without LoRA, and a
LoRA-enabled runtime serving base-only traffic (which must cost nothing).

Paths: ``eager`` (prepare + eager forward), ``graph`` (what a serving loop calls per step:
LoRA plan, static-buffer refresh, replay) and ``replay_only`` (the captured graph alone: the
device time, without host-side preparation). Each next to the weight-bytes floor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench import nvtx_ranges
from bench.hardware import Ceilings
from bench.timing import bench_time
from graphs import GraphRunner
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelCase:
    preset: str
    layers: int
    batch_sizes: tuple[int, ...]
    context: int
    adapters: int
    rank: int
    backend: str
    dtype: torch.dtype


def run_model_case(case: ModelCase, device: torch.device, ceil: Ceilings, reps: int) -> list[dict]:
    """Two runtimes over identical weights: one built without LoRA, one with LoRA serving
    base-only traffic and LoRA traffic."""
    rows = []
    for runtime in ("no_lora", "lora"):
        rows += _run_runtime(case, runtime, device, ceil, reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _run_runtime(case, runtime, device, ceil, reps) -> list[dict]:
    config = PRESETS[case.preset](case.layers)
    model = LlamaForCausalLM.random(config, case.dtype, device)
    max_bs = max(case.batch_sizes)
    kv = KVCache(config, max_bs * (case.context + 8) + 8, case.dtype, device)
    names, lora = [], None
    if runtime == "lora":
        lora = LoRAManager(model, LoRAConfig(max(1, case.adapters), case.rank,
                                             backend=case.backend))
        names = [f"bench{i}" for i in range(case.adapters)]
        for i, n in enumerate(names):
            lora.load_adapter(n, random_adapter(config, n, case.rank, seed=i, dtype=case.dtype))
    runner = ModelRunner(model, kv, lora)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with nvtx_ranges.range(f"capture {case.preset} L={case.layers} {runtime}"):
        graphs = GraphRunner.decode(runner, list(case.batch_sizes), case.context + 8).capture()
    runner.graphs.clear()  # eager and graph paths are timed explicitly below
    rows = []
    for bs in case.batch_sizes:
        for traffic in (["base"] if lora is None else ["base", "lora"]):
            adapters = [names[i % len(names)] if traffic == "lora" else None for i in range(bs)]
            reqs = [Request(torch.randint(0, config.vocab_size, (case.context,)).tolist(), a, 4)
                    for a in adapters]
            group = max(1, 2048 // case.context)  # prefill attention is dense per batch
            for i in range(0, bs, group):
                runner.forward_eager(build_extend(reqs[i : i + group], kv, device))
            for r in reqs:
                r.output.append(1)
            batch = build_decode(reqs, kv, device)
            label = f"{case.preset} L={case.layers} bs={bs} {runtime}/{traffic}"
            graphs.replay(batch)  # refreshes the static buffers for the replay-only timing
            captured = graphs.graphs[(graphs.last_kind, graphs.buffers.bucket_for(batch))]
            for path, fn in (("eager", lambda b=batch: runner.forward_eager(b)),
                             ("graph", lambda b=batch: graphs.replay(b)),
                             ("replay_only", captured.replay)):
                with nvtx_ranges.range(f"decode {path} {label}"):
                    t = bench_time(fn, device=device, mode="events", reps=reps, warmup=3)
                rows.append(_row(case, bs, runtime, traffic, path, t, weight_bytes, ceil,
                                 graphs.last_kind if path != "eager" else None))
            kv.free([s for r in reqs for s in r.kv_slots])
    rows.append({
        "suite": "model", "kind": "capture", "preset": case.preset, "layers": case.layers,
        "runtime": runtime, "backend": case.backend,
        "dtype": str(case.dtype).removeprefix("torch."), "buckets": list(case.batch_sizes),
        "capture_seconds": graphs.stats.total_capture_seconds,
        "graph_memory_bytes": graphs.stats.memory_bytes, "graphs": len(graphs.graphs),
    })
    return rows


def _row(case, bs, runtime, traffic, path, t, weight_bytes, ceil, graph_kind) -> dict:
    floor_us = weight_bytes / (ceil.copy_gbps * 1e3)
    return {
        "suite": "model", "kind": "decode_step", "preset": case.preset, "layers": case.layers,
        "batch_size": bs, "context": case.context, "runtime": runtime, "traffic": traffic,
        "adapters": case.adapters if traffic == "lora" else 0, "rank": case.rank,
        "backend": case.backend, "dtype": str(case.dtype).removeprefix("torch."),
        "path": path, "graph_kind": graph_kind, **t.summary(),
        "tokens_per_s": bs / (t.median_us * 1e-6), "weight_bytes": weight_bytes,
        "floor_us": floor_us, "x_floor": t.median_us / floor_us,
    }
