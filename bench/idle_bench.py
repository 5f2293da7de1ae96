"""Idle-path suite: what a LoRA runtime costs when LoRA has nothing to do, next to a runtime
built without LoRA (same weights), eager and graph.

``idle_forward``: a forward without tokens (a DP rank whose peers have work), its batch built
as a serving loop builds it (which resets the LoRA batch); without DP its graph path replays
the smallest bucket's graph without LoRA. ``base_batch``: a decode batch of base-only traffic
at ``batch_size`` requests.

Verified before timing, in both runtimes: the graph step equals the eager forward and replayed
the graph without LoRA, no LoRA batch is left prepared (no LoRA launch), and for
``base_batch`` the LoRA runtime's logits equal the runtime without LoRA's; an idle forward
returns no rows and leaves the KV cache unchanged past the scratch slot. A case failing
verification is one failed row, not timed.

Rows: one per (runtime, path); derived: ``overhead_pct`` (lora over no_lora, same case and
path), ``graph_kind``, ``tokens``, and where the forward reads every weight (all but the eager
idle forward, which has no rows) ``floor_us`` (the weight matrices a forward reads whole,
not the embedding table, over the measured copy bandwidth) and ``x_floor``.
"""

from __future__ import annotations

import gc

import torch

from bench.context import Context
from bench.logits_match import assert_logits_match
from bench.model_runtime import BenchRuntime
from bench.results import make_row
from bench.scenarios import IdleCase
from bench.timing import bench_interleaved, pair_ratio
from lora_runtime.nvtx import nvtx_range

RUNTIMES = ("no_lora", "lora")
EAGER_REPS = 3
"""Eager forwards are timed this many times the profile's repetitions: their latency on a
shared host swings more than a replay's."""
PATHS = ("eager", "graph")
IDLE_BUCKET = 1


def cases(preset: str, layers: int, dtype: str, context: int, batch_sizes, adapters: int,
          rank: int) -> list[IdleCase]:
    return [IdleCase(preset, layers, dtype, "idle_forward", 0, 0, adapters, rank)] + [
        IdleCase(preset, layers, dtype, "base_batch", bs, context, adapters, rank)
        for bs in batch_sizes]


class RuntimePair:
    """The runtime with LoRA and the one without of the last case's model, shared by the
    selected cases of that model: decode graphs at bucket 1 (the idle forward's) and at each
    selected batch size, context the largest selected."""

    def __init__(self, todo: list[IdleCase], device: torch.device) -> None:
        self.device = device
        self.todo = todo
        self.key, self.runtimes = None, {}

    @staticmethod
    def _key(c: IdleCase) -> tuple:
        return (c.preset, c.layers, c.dtype, c.adapters, c.rank)

    def get(self, case: IdleCase) -> dict[str, BenchRuntime]:
        if self._key(case) == self.key:
            return self.runtimes
        self.runtimes = {}
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        mine = [c for c in self.todo if self._key(c) == self._key(case)]
        sizes = sorted({IDLE_BUCKET, *(c.batch_size for c in mine if c.batch_size)})
        context = max(c.context for c in mine)
        backend = "triton" if self.device.type == "cuda" else "torch"
        with nvtx_range(f"capture {case.label}"):
            self.runtimes = {
                rt: BenchRuntime("decode", case.preset, case.layers, context,
                                 case.adapters if rt == "lora" else 0,
                                 (case.rank,) if rt == "lora" else (), backend,
                                 getattr(torch, case.dtype), sizes, self.device)
                for rt in RUNTIMES}
        self.key = self._key(case)
        return self.runtimes


def make_runner(todo: list[IdleCase], ctx: Context):
    pairs = RuntimePair(todo, ctx.device)
    return lambda case: run_case(case, ctx, pairs)


def run_case(case: IdleCase, ctx: Context, pairs: RuntimePair) -> list[dict]:
    rts = pairs.get(case)
    batches = {}
    try:
        try:
            if case.scenario == "idle_forward":
                check = _verify_idle(case, rts)
                fns = {(n, p): rt.idle_eager if p == "eager" else rt.idle_step
                       for n, rt in rts.items() for p in PATHS}
            else:
                for n, rt in rts.items():  # one by one: one that raises frees the others
                    batches[n] = rt.batch(case.batch_size, "base", seed=case.batch_size)
                for rt in rts.values():  # other requests of this shape: a stale refresh shows
                    rt.prime(case.batch_size)
                check = _verify_base_batch(case, rts, batches)
                fns = {(n, p): (lambda rt=rt, b=batches[n][0], p=p:
                                rt.eager(b) if p == "eager" else rt.step(b))
                       for n, rt in rts.items() for p in PATHS}
        except AssertionError as e:
            return [make_row(case, ctx.profile, {"runtime": "all", "path": "all"},
                             verification={"status": "failed", "error": str(e)})]
        with nvtx_range(f"eager {case.label}"):  # the two runtimes alternating
            eager = bench_interleaved({n: fn for (n, p), fn in fns.items() if p == "eager"},
                                      device=ctx.device, reps=EAGER_REPS * ctx.reps)
        timed = {(n, "eager"): t for n, t in eager.items()}
        kinds = dict.fromkeys(timed)
        with nvtx_range(f"graph {case.label}"):  # the two runtimes' replays alternating
            timed |= bench_interleaved({k: fn for k, fn in fns.items() if k[1] != "eager"},
                                       device=ctx.device, reps=ctx.reps, mode="events")
        kinds |= {(n, p): rts[n].last_kind for n, p in timed if p != "eager"}
        return [make_row(case, ctx.profile, {"runtime": n, "path": p}, timing=t,
                         derived=_derived(case, rts[n], t, timed[("no_lora", p)], p, ctx)
                         | {"graph_kind": kinds[(n, p)]}, verification=check)
                for (n, p), t in timed.items()]
    finally:
        for name, (_, reqs) in batches.items():
            rts[name].release(reqs)


def _verify_idle(case: IdleCase, rts: dict[str, BenchRuntime]) -> dict:
    for name, rt in rts.items():
        kv = rt.kv_past_scratch()
        for path, forward in (("eager", rt.idle_eager), ("graph", rt.idle_step)):
            what = f"{case.label}: the {name} runtime's {path} idle forward"
            # After a step with LoRA rows (a DP rank going idle): its batch must not be run.
            rt.leave_lora_batch()
            try:
                out = forward()
            except (RuntimeError, ValueError) as e:
                raise AssertionError(f"{what} after a LoRA batch raised: {e}") from e
            if out.shape[0] != 0:
                raise AssertionError(f"{what} returned {out.shape[0]} rows, expected 0")
            if rt.lora_active:
                raise AssertionError(f"{what} left a LoRA batch prepared (LoRA launches)")
        _expect_base_graph(case, name, rt)
        if any(not torch.equal(a, b) for a, b in zip(kv, rt.kv_past_scratch(), strict=True)):
            raise AssertionError(f"{case.label}: the {name} runtime's idle forwards wrote KV "
                                 "slots other than the scratch slot")
    return {"status": "verified", "error": None,
            "checks": ["no rows out (eager and graph)", "graph without LoRA replayed",
                       "a LoRA batch left prepared before it is not run",
                       "no LoRA batch prepared", "KV cache unchanged past the scratch slot"]}


def _verify_base_batch(case: IdleCase, rts: dict[str, BenchRuntime], batches) -> dict:
    dtype = getattr(torch, case.dtype)
    eager, errs = {}, {}
    for name, rt in rts.items():
        batch = batches[name][0]
        eager[name] = rt.eager(batch).clone()
        what = f"{case.label}: the {name} runtime's"
        if rt.lora_active:
            raise AssertionError(f"{what} eager forward of base traffic prepared a LoRA batch")
        errs[f"max_rel_err_graph_vs_eager_{name}"] = assert_logits_match(
            rt.step(batch), eager[name], dtype, f"{what} graph step differs from its eager "
            "forward of the same batch")
        _expect_base_graph(case, name, rt)
    errs["max_rel_err_lora_vs_no_lora"] = assert_logits_match(
        eager["lora"], eager["no_lora"], dtype, f"{case.label}: base traffic in the LoRA "
        "runtime differs from the runtime without LoRA")
    return {"status": "verified", "error": None, **errs,
            "checks": ["graph step == eager", "graph without LoRA replayed",
                       "no LoRA batch prepared", "LoRA runtime == runtime without LoRA"]}


def _expect_base_graph(case: IdleCase, name: str, rt: BenchRuntime) -> None:
    if rt.last_kind != "base":
        raise AssertionError(f"{case.label}: the {name} runtime replayed the {rt.last_kind} "
                             "graph, expected the graph without LoRA")
    if rt.lora_active:
        raise AssertionError(f"{case.label}: the {name} runtime's graph step left a LoRA "
                             "batch prepared")


def _derived(case: IdleCase, rt: BenchRuntime, t, base, path: str, ctx: Context) -> dict:
    # The two runtimes were timed alternating, so each rep is judged against its partner
    # (the median of the rep-by-rep ratios).
    ratio = pair_ratio(t, base)
    out = {"tokens": case.batch_size, "overhead_pct": 100 * (ratio - 1) if t is not base else None}
    if case.scenario == "base_batch" or path == "graph":
        floor_us = rt.weight_bytes / (ctx.ceilings.copy_gbps * 1e3)
        out |= {"weight_bytes": rt.weight_bytes, "floor_us": floor_us,
                "x_floor": t.median_us / floor_us}
    return out


def table(rows: list[dict]) -> str:
    from bench.table import fmt, render

    cell = {(r["label"], r["runtime"], r["path"]): r for r in rows if r.get("stats")}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    status = {r["label"]: r["verification"]["status"] for r in rows}
    body = []
    for label in labels:
        line = [label]
        for path in PATHS:
            nl, lo = cell.get((label, "no_lora", path)), cell.get((label, "lora", path))
            pct = lo and lo["derived"]["overhead_pct"]
            line += [fmt(nl and nl["stats"]["median_us"]), fmt(lo and lo["stats"]["median_us"]),
                     "-" if pct is None else f"{pct:+.1f}%"]
        body.append(line + [status[label]])
    head = ["case", "eager no-LoRA us", "eager LoRA us", "eager overhead", "graph no-LoRA us",
            "graph LoRA us", "graph overhead", "status"]
    return render(head, body)
