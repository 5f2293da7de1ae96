"""Decode and prefill steps of the whole model: eager vs graph, a runtime without LoRA, and a
LoRA runtime serving base-only traffic (which must cost nothing) and LoRA traffic.

A case is one runtime (``adapters == 0``: built without LoRA) at one batch size (prefill:
``batch_size`` prompts of ``context`` tokens). Paths:
``eager`` (prepare + eager forward), ``graph`` (what a serving loop calls per step: LoRA plan,
static-buffer refresh, replay) and ``replay_only`` (the captured graph alone). Before timing,
every traffic of the case is verified: the graph step equals an eager forward of the same
batch, the expected graph (with or without LoRA) replayed, and the static LoRA buffers are
neutral past the batch. A case that fails is reported as failed and not timed.

Rows: one per (traffic, path); derived: ``tokens_per_s``, ``weight_bytes``, ``floor_us``
(the bytes of the weight matrices a forward reads whole, not the embedding table, over
the measured copy bandwidth), ``x_floor``, ``graph_kind``, on LoRA
traffic rows ``lora_bytes`` and ``lora_floor_us`` (the batch's distinct adapters' weights, the
least LoRA can add: ``bench.lora_floor``) and, on graph rows, the runtime's capture figures.

Timing: the eager forwards of every traffic alternate rep by rep, and so do the graph steps and
replays of every traffic (CUDA events): graph rows carry ``host_us`` (the median of the
rep-by-rep step minus replay: the host's share of a step), LoRA traffic's graph and replay
rows ``lora_over_base_traffic`` (the median of the rep-by-rep ratios to base traffic's),
eager LoRA rows ``eager_lora_over_base``. Separately timed windows drift apart (a bs-256
replay by ~5% between windows a second apart); pairs do not.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from bench.case import Case
from bench.context import Context
from bench.logits_match import assert_logits_match
from bench.lora_floor import adapter_bytes, floor_us
from bench.model_runtime import BenchRuntime
from bench.reference_checks import LORA_CHECK
from bench.results import make_row
from bench.timing import bench_interleaved, pair_difference, pair_ratio
from lora_runtime.nvtx import nvtx_range

PATHS = ("eager", "graph", "replay_only")


@dataclass(frozen=True)
class ModelCase(Case):
    suite = "model"
    step: str
    preset: str
    layers: int
    context: int
    batch_size: int
    adapters: int
    """0: a runtime built without LoRA."""
    ranks: tuple[int, ...]
    """Adapter i has rank ranks[i % len(ranks)] (several: a mixed-rank set)."""
    backend: str
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.step not in ("decode", "prefill"):
            raise ValueError(f"model step must be 'decode' or 'prefill', got {self.step!r}")
        if self.adapters and not self.ranks:
            raise ValueError("a LoRA case needs ranks, e.g. ranks=(16,)")

    @property
    def label(self) -> str:
        rt = (f"adapters={self.adapters} r={'/'.join(map(str, self.ranks))}" if self.adapters
              else "no-lora")
        return (f"model {self.step} {self.preset} L={self.layers} ctx={self.context} "
                f"bs={self.batch_size} {rt}")

    @property
    def runtime_key(self) -> tuple:
        """Cases that can share one runtime (they differ in batch size only)."""
        return (self.step, self.preset, self.layers, self.context, self.adapters, self.ranks,
                self.backend, self.dtype)

    @property
    def tokens(self) -> int:
        return self.batch_size * (self.context if self.step == "prefill" else 1)

    @property
    def traffics(self) -> tuple[str, ...]:
        return ("base", "lora") if self.adapters else ("base",)


def cases(step: str, preset: str, layers: int, context: int, batch_sizes, runtimes,
          backend: str, dtype: torch.dtype) -> list[ModelCase]:
    """``runtimes``: (adapters, ranks) pairs; (0, ()) is the runtime without LoRA."""
    return [ModelCase(step, preset, layers, context, bs, a, tuple(r), backend, dtype)
            for a, r in runtimes for bs in batch_sizes]


class RuntimeCache:
    """Keeps the runtime of the last case, so consecutive cases of one runtime share it; the
    runtime captures one bucket per selected batch size of its cases."""

    def __init__(self, todo: list[ModelCase], device: torch.device) -> None:
        self.device = device
        self.sizes: dict[tuple, list[int]] = {}
        for c in todo:
            self.sizes.setdefault(c.runtime_key, []).append(c.batch_size)
        self.key, self.runtime = None, None

    def get(self, case: ModelCase) -> BenchRuntime:
        if case.runtime_key != self.key:
            self.runtime = None
            gc.collect()  # the previous runtime's graphs and weights, before the next capture
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            with nvtx_range(f"capture {case.label}"):
                self.runtime = BenchRuntime(
                    case.step, case.preset, case.layers, case.context, case.adapters, case.ranks,
                    case.backend, case.dtype, self.sizes[case.runtime_key], self.device)
            self.key = case.runtime_key
        return self.runtime


def run_case(case: ModelCase, ctx: Context, runtimes: RuntimeCache) -> list[dict]:
    rt = runtimes.get(case)
    rt.prime(case.batch_size)  # other requests of this shape: a stale refresh then shows
    batches = {}
    try:
        for t in case.traffics:  # one by one: a batch that raises frees those built before
            batches[t] = rt.batch(case.batch_size, t)
        try:
            checks = {t: _verify(case, rt, batch, reqs) for t, (batch, reqs) in
                      batches.items()}
        except AssertionError as e:
            return [make_row(case, ctx.profile, {"traffic": "all", "path": "graph"},
                             verification={"status": "failed", "error": str(e)})]
        rows = []
        with nvtx_range(f"eager {case.label}"):  # every traffic, alternating
            eager = bench_interleaved({t: (lambda b=b: rt.eager(b)) for t, (b, _) in
                                       batches.items()}, device=ctx.device, reps=ctx.reps)
        kinds, replayed = {}, {}
        for traffic, (batch, _) in batches.items():
            # Hazard: a replay alone reads what the last step wrote into the static buffers:
            # each traffic's replay comes right after its own step in the alternation.
            replayed[(traffic, "graph")] = lambda b=batch: rt.step(b)
            replayed[(traffic, "replay_only")] = rt.replay_only(batch)
            kinds[traffic] = rt.last_kind
        with nvtx_range(f"graph {case.label}"):  # every traffic's step and replay, alternating
            graph = bench_interleaved(replayed, device=ctx.device, reps=ctx.reps,
                                      mode="events")
        for traffic, (batch, _) in batches.items():
            for path in PATHS:
                t = eager[traffic] if path == "eager" else graph[(traffic, path)]
                derived = _derived(case, rt, t, ctx, None if path == "eager" else kinds[traffic])
                if path == "graph":
                    derived["host_us"] = pair_difference(t, graph[(traffic, "replay_only")])
                if path != "eager" and traffic == "lora":
                    derived["lora_over_base_traffic"] = pair_ratio(t, graph[("base", path)])
                if traffic == "lora":
                    nbytes = adapter_bytes(rt.lora, batch.adapter_names)
                    derived |= {"lora_bytes": nbytes,
                                "lora_floor_us": floor_us(nbytes, ctx.ceilings.copy_gbps)}
                if path == "graph":
                    derived |= rt.capture_stats
                if path == "eager" and traffic == "lora" and "base" in eager:
                    derived["eager_lora_over_base"] = pair_ratio(t, eager["base"])
                rows.append(make_row(case, ctx.profile, {"traffic": traffic, "path": path},
                                     timing=t, derived=derived, verification=checks[traffic]))
        return rows
    finally:
        for _, reqs in batches.values():
            rt.release(reqs)


def _verify(case: ModelCase, rt: BenchRuntime, batch, reqs) -> dict:
    eager = rt.eager(batch).clone()
    got = rt.step(batch)
    err = assert_logits_match(got, eager, case.dtype, f"{case.label}: graph replay differs "
                              f"from the eager forward of the same batch ({rt.last_kind} graph)",
                              case.layers)
    want = rt.expected_kind(batch)
    if rt.last_kind != want:
        raise AssertionError(f"{case.label}: replayed the {rt.last_kind} graph, expected {want}")
    if rt.last_kind == "lora":
        rt.check_neutral_past(batch.num_tokens, batch.batch_size)
    # Graph and eager share the LoRA math (slot images, layouts, backend, kernels) and the base
    # model's: the eager logits of every traffic (base traffic and the runtime without LoRA
    # too: the base step suite's batches hold one token id and one context length) against
    # each request alone in float64.
    ref = rt.check_against_float64(eager, reqs, f"{case.label}: the eager forward")
    return {"status": "verified", "error": None, "max_rel_err_vs_eager": err, **ref,
            "checks": ["replay == eager", "graph kind", "neutral past the batch"
                       if rt.last_kind == "lora" else "no LoRA graph",
                       LORA_CHECK]}


def _derived(case, rt, t, ctx, graph_kind) -> dict:
    floor_us = rt.weight_bytes / (ctx.ceilings.copy_gbps * 1e3)
    return {"graph_kind": graph_kind, "tokens": case.tokens,
            "tokens_per_s": case.tokens / (t.median_us * 1e-6),
            "weight_bytes": rt.weight_bytes, "floor_us": floor_us,
            "x_floor": t.median_us / floor_us}
