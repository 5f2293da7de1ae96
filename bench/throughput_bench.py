"""Throughput suite: the serving engine on offline workloads, base model vs LoRA at several
adapter counts and popularities: output tokens/s, requests/s, TTFT and TPOT (p50, p99),
joules per token (NVML), LoRA throughput as a % of the base model's on the same workload.

Each case serves its workload on its runtime with captured decode and prefill graphs (prefill
buckets by token count up to the step's budget, continuations of chunked prompts included):
the engine's warm-up, an untimed pass, then ``TIMED_PASSES`` timed passes. A LoRA case builds
a runtime without LoRA beside it (same weights) and interleaves its passes with the case's,
so ``pct_of_base`` compares passes made under the same conditions: the median over the
timed passes of a pass's tokens/s as a % of its base pass's just before it;
``pct_of_base_at_floor`` is the % of base the case would reach if LoRA added only its bytes
floor to the median base pass (``lora_floor_ms``: each step's distinct adapters read once at
the measured copy rate, ``bench.lora_floor``). Verification: every request produced all its
tokens; every timed pass repeats the untimed pass's tokens (greedy, same schedule: a replay
that read stale metadata after the slot churn of the first pass would change them) up to a
near-tie: a request may diverge only at a token whose top-2 logit margin in the untimed pass
was within ``bench.token_reference.near_tie`` (the split-K shrink adds in fp32 with atomics,
so bf16 logits move by an ulp between runs); and the untimed pass's tokens match an eager
forward outside the engine (``bench.token_reference``)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench.context import Context
from bench.lora_floor import pass_floor_ms
from bench.results import make_row
from bench.scenarios import ThroughputCase
from bench.timing import Timing
from bench.token_reference import judge, near_tie, token_reference
from graphs import GraphRunner
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload, serve
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM

SLOTS = 16
"""Adapter slots of a LoRA runtime (``max_loras_per_batch``): a workload with more adapters
moves them in and out of slots while it runs, and a decode batch holds at most this many."""
OVERLAP = True
"""Serve with ``Engine(overlap=True)``: each step's successor (a decode or a prefill) is built
and launched before the step's tokens are read, wherever only a stop token could change it,
so the host builds step n+1 while the device runs step n (the engine's step was ~50% host
time on the H200 host)."""
TIMED_PASSES = 5
"""Timed passes per case (one pass is 0.2-0.8 s on the H200: single passes swung by up to
50% between similar cases); the row reports the median pass, its samples every pass."""


def cases(preset: str, layers: int, dtype: str, prompt: int, output: int, requests: int,
          runtimes, rank: int) -> list[ThroughputCase]:
    """``runtimes``: (adapters, popularity) pairs; (0, "-") is the base model."""
    wl = f"in{prompt}-out{output}"
    return [ThroughputCase(preset, layers, dtype, wl, requests, a, pop, str(rank) if a else "-")
            for a, pop in runtimes]


def make_runner(ctx: Context):
    def run(case: ThroughputCase) -> list[dict]:
        return [run_case(case, ctx)]

    return run


def run_case(case: ThroughputCase, ctx: Context) -> dict:
    """A LoRA case also serves the workload on a runtime without LoRA (the same weights),
    its timed passes interleaved with the case's (base, LoRA, base, LoRA, ...): ``pct_of_base``
    compares passes made under the same host and device conditions (the H200 machines' hosts
    drifted by 25% between sessions, and by ~10% from case to case)."""
    prompt, output = (int(x) for x in case.workload.removeprefix("in").split("-out"))
    spec = WorkloadSpec(case.requests, prompt, output,
                        popularity=case.popularity if case.adapters else "none",
                        num_adapters=max(case.adapters, 1), seed=1)
    main = _Runtime(case, ctx, spec, case.adapters)
    workload = make_workload(spec, main.config.vocab_size)
    base = _Runtime(case, ctx, spec, 0) if case.adapters else None
    # The base runtime serves the same requests, each on the base model.
    base_workload = [dataclasses.replace(w, adapter=None) for w in workload]
    for rt, wl in ((main, workload), (base, base_workload)):
        if rt is not None:
            rt.untimed_pass(wl)
    for _ in range(TIMED_PASSES):
        for rt, wl in ((base, base_workload), (main, workload)):
            if rt is not None:
                rt.timed_pass(wl)
    tie = near_tie(case.dtype)
    verification = verify_passes(main.passes, workload, main.margins, tie)
    if verification["status"] == "verified":
        verification = _verify_reference(main, workload, verification, tie)
    if verification["status"] == "verified":
        verification = _verify_ragged(main, workload, verification, tie)
    if base is not None and verification["status"] == "verified":
        check = verify_passes(base.passes, base_workload, base.margins, tie)
        if check["status"] == "verified":
            check = _verify_reference(base, base_workload, check, tie)
        if check["status"] == "verified":
            check = _verify_ragged(base, base_workload, check, tie)
        if check["status"] != "verified":
            verification = {**check, "error": f"interleaved base runtime: {check['error']}"}
    if verification["status"] == "failed":  # not timed as if good: no stats, no figures
        main.release()
        if base is not None:
            base.release()
        return make_row(case, ctx.profile, {}, verification=verification)
    wall, reqs, timeline, rec, writes = sorted(main.runs, key=lambda r: r[0])[len(main.runs) // 2]
    tokens = sum(len(o) for o in main.passes[1])
    ttft = sorted(r.metrics.ttft for r in reqs)
    tpot = sorted(r.metrics.tpot for r in reqs if r.metrics.tpot is not None)
    energy = (rec or {}).get("energy_j")
    derived = {
        "output_tokens_per_s": tokens / wall, "requests_per_s": len(reqs) / wall,
        "output_tokens": tokens, "duration_s": wall,
        "ttft_p50_ms": 1e3 * _q(ttft, 0.5), "ttft_p99_ms": 1e3 * _q(ttft, 0.99),
        "tpot_p50_ms": 1e3 * _q(tpot, 0.5) if tpot else None,
        "tpot_p99_ms": 1e3 * _q(tpot, 0.99) if tpot else None,
        "pass_energy_j": energy,
        "joules_per_token": None if energy is None else energy / tokens,
        "graph_steps": sum(s.graph for s in timeline), "steps": len(timeline),
        "ahead_steps": sum(s.ahead for s in timeline),
        "warm_up_s": main.warm.seconds, "timed_compiles": _compiles(timeline),
        "slot_writes": writes, "slot_write_ms": main.slot_write_ms,
        **_step_split(timeline),
    }
    if base is not None:
        base_wall, _, base_timeline, _, _ = sorted(base.runs, key=lambda r: r[0])[
            len(base.runs) // 2]
        base_tps = sum(len(o) for o in base.passes[1]) / base_wall
        pairs = _paired_pct(main, base)
        floor_ms = pass_floor_ms(main.lora, timeline, ctx.ceilings.copy_gbps)
        derived |= {"base_output_tokens_per_s": base_tps,
                    "pct_of_base": statistics.median(pairs), "pct_of_base_pairs": pairs,
                    "lora_floor_ms": floor_ms,
                    "pct_of_base_at_floor": 100 * base_wall / (base_wall + floor_ms / 1e3),
                    **{f"base_{k}": v for k, v in _step_split(base_timeline).items()}}
    main.release()
    if base is not None:
        base.release()
    return make_row(case, ctx.profile, {},
                    timing=Timing([r[0] * 1e6 for r in main.runs], "wall"),
                    derived=derived, telemetry=rec or None, verification=verification)


def _paired_pct(main: _Runtime, base: _Runtime) -> list[float]:
    """Tokens/s of each timed pass as % of its base pass just before it (the pairs the
    interleaving made): the median of these is robust to a drift of the device or host
    across the case, where the ratio of the two medians mixes passes minutes apart."""
    def tps(rt: _Runtime) -> list[float]:
        return [sum(len(o) for o in outs) / run[0]
                for outs, run in zip(rt.passes[1:], rt.runs, strict=True)]
    return [100 * m / b for m, b in zip(tps(main), tps(base), strict=True)]


class _Runtime:
    """One runtime serving the case's workload: ``adapters`` LoRA adapters (0: no LoRA), its
    graphs, warm-up, untimed pass (tokens and top-2 margins kept for verification) and timed
    passes."""

    def __init__(self, case: ThroughputCase, ctx: Context, spec: WorkloadSpec,
                 adapters: int) -> None:
        self.ctx, device = ctx, ctx.device
        dtype = getattr(torch, case.dtype)
        prompt, output = spec.prompt_len, spec.output_len
        self.config = config = PRESETS[case.preset](case.layers)
        model = LlamaForCausalLM.random(config, dtype, device, seed=0)
        lora = None
        if adapters:
            rank = int(case.ranks)
            slots = min(len(spec.adapter_names), SLOTS)
            lora = LoRAManager(model, LoRAConfig(slots, rank, backend="triton" if device.type ==
                                                 "cuda" else "torch"))
            for i, name in enumerate(spec.adapter_names):
                lora.load_adapter(name, random_adapter(config, name, rank, seed=i, dtype=dtype))
        max_batch = min(32, case.requests)
        kv = KVCache(config, max_batch * (prompt + output) + 64, dtype, device)
        self.runner = ModelRunner(model, kv, lora)
        buckets = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch] + [max_batch]
        self.sched = SchedulerConfig(max_batch_size=max_batch)
        self.graphs = [
            GraphRunner.decode(self.runner, buckets, prompt + output + 8).capture(),
            GraphRunner.prefill(self.runner, prefill_buckets(prompt, max_batch,
                                                             self.sched.max_step_tokens),
                                max_batch, max_prefix=prompt).capture()]
        self.warm = Engine(self.runner, self.sched, self.graphs).warm_up()
        self.lora = lora
        self.slot_write_ms = None if lora is None else _slot_write_ms(lora, device)
        self.passes: list[list[list[int]]] = []
        self.margins: dict[int, list[float]] = {}
        self.logits: dict = {}  # the untimed pass's logits rows, by workload index
        self.runs: list[tuple] = []

    def untimed_pass(self, workload) -> None:
        engine = Engine(self.runner, self.sched, self.graphs, keep_logits=True,
                        overlap=OVERLAP)
        reqs = serve(engine, workload)
        self.margins = {i: [float(t[0] - t[1]) for t in
                            (row.float().topk(2).values for row in engine.logits[r.id])]
                        for i, r in enumerate(reqs)}
        self.logits = {i: engine.logits[r.id] for i, r in enumerate(reqs)}
        self.passes.append([list(r.output) for r in reqs])

    def timed_pass(self, workload) -> None:
        engine = Engine(self.runner, self.sched, self.graphs, overlap=OVERLAP)
        writes = 0 if self.lora is None else self.lora.writer.writes
        with self.ctx.telemetry.span() as rec:
            t0 = engine.clock()
            reqs = serve(engine, workload)
            _sync(self.ctx.device)
            wall = engine.clock() - t0
        writes = 0 if self.lora is None else self.lora.writer.writes - writes
        self.runs.append((wall, reqs, engine.timeline, rec, writes))
        self.passes.append([list(r.output) for r in reqs])

    def release(self) -> None:
        self.graphs.clear()


def _slot_write_ms(lora: LoRAManager, device: torch.device, n: int = 8) -> float | None:
    """Wall time of moving one adapter into a slot (evicting the least recently used one),
    device work included: the median over up to ``n`` adapters that hold no slot (None when
    every adapter is resident)."""
    lora.reset_lora_batch()  # the warm-up's last batch is done: its adapters may be evicted
    times = []
    for name in [a for a in lora.adapters if a not in lora.pool.slot_of][:n]:
        _sync(device)
        t0 = time.perf_counter()
        lora.pin_adapter(name)
        _sync(device)
        times.append(time.perf_counter() - t0)
        lora.pin_adapter(name, False)
    return 1e3 * statistics.median(times) if times else None


def _compiles(timeline) -> int | None:
    """Kernel variants the timed steps compiled (0 after a complete warm-up)."""
    counts = [s.compiles for s in timeline]
    return None if any(c is None for c in counts) else sum(counts)


def prefill_buckets(prompt: int, max_batch: int, max_step_tokens: int) -> list[int]:
    """Token buckets of the prefill graphs: powers of two from one prompt up to the step's
    token budget (a chunked prompt's tail, or several prompts, fit the next one up)."""
    top = min(max_step_tokens, prompt * max_batch)
    sizes, b = [], 1 << max(0, (prompt - 1).bit_length())
    while b < top:
        sizes.append(b)
        b *= 2
    return [*sizes, top]


def _step_p50(timeline, mode: str) -> float | None:
    secs = [s.seconds for s in timeline if s.mode == mode]
    return 1e3 * statistics.median(secs) if secs else None


def _step_split(timeline) -> dict:
    """Per step mode (decode, extend): the median step and the pass's total time in steps of
    that mode (ms). A LoRA case's and its base's totals say where its throughput went."""
    out = {}
    for mode in ("decode", "extend"):
        out[f"{mode}_step_ms_p50"] = _step_p50(timeline, mode)
        out[f"{mode}_ms_total"] = 1e3 * sum(s.seconds for s in timeline if s.mode == mode)
    return out


def verify_passes(passes, workload, margins, tie: float) -> dict:
    """Every timed pass (``passes[1:]``, each request's tokens in ``workload``'s order)
    against the untimed pass (``passes[0]``, whose top-2 logit margins are ``margins``)."""
    short = [i for p in passes for i, (o, w) in enumerate(zip(p, workload, strict=True))
             if len(o) != w.max_new_tokens]
    if short:
        return {"status": "failed", "error": f"requests {short[:5]} produced too few tokens"}
    diverged, bad = [], []
    pairs = [(i, a, b) for p in passes[1:] for i, (a, b) in enumerate(zip(passes[0], p,
                                                                         strict=True))]
    for i, a, b in pairs:
        k = next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if k is None:
            continue
        diverged.append(i)
        if margins[i][k] > tie:
            bad.append((i, k, round(margins[i][k], 3)))
    if bad:
        return {"status": "failed",
                "error": f"(request, token, warm-up margin) {bad[:5]}: the timed pass chose "
                         f"another token where the warm-up's top-2 margin exceeded {tie}"}
    return {"status": "verified", "error": None, "diverged_at_near_ties": len(diverged),
            "checks": ["every request produced all its tokens",
                       f"timed pass tokens == warm-up's up to a near-tie (margin <= {tie})"]}


RAGGED_CHECK = ("the workload made ragged, untimed (request i: prompt and output shortened by "
                "i modulo half the prompt, and by i modulo the output): tokens and logits rows "
                "== an eager forward outside the engine")


def _ragged(workload) -> list:
    """``workload`` with staggered lengths: requests finish one by one, so decode batches
    shrink through sizes between graph buckets (padded replays) and mix context lengths."""
    out = []
    for i, w in enumerate(workload):
        p, o = len(w.prompt), w.max_new_tokens
        out.append(dataclasses.replace(w, prompt=list(w.prompt[: p - i % max(1, p // 2)]),
                                       max_new_tokens=o - i % o))
    return out


def _verify_ragged(rt: _Runtime, workload, verification: dict, tie: float) -> dict:
    """The case's workload has one prompt and one output length: every decode batch holds
    requests of one context length and fills its graph bucket, so a fault in padded replays
    (padding rows writing a request's cache slot) or in masking unequal contexts is never
    run. An untimed pass of the same runtime over the workload made ragged (``_ragged``) is
    checked like the untimed pass (``token_reference`` with the logits rows)."""
    workload = _ragged(workload)
    engine = Engine(rt.runner, rt.sched, rt.graphs, keep_logits=True, overlap=OVERLAP)
    reqs = serve(engine, workload)
    rows = {i: engine.logits[r.id] for i, r in enumerate(reqs)}
    found = token_reference(rt.runner.model, rt.lora, workload, [list(r.output) for r in reqs],
                            tie, engine_logits=rows)
    v = judge(found, rt.runner.model, tie, verification, RAGGED_CHECK)
    if v["status"] != "verified":
        return {**v, "error": f"ragged workload: {v['error']}"}
    return {**verification, "checks": v["checks"],
            "ragged_max_rel_err_logits_vs_eager": v.get("max_rel_err_logits_vs_eager"),
            "ragged_max_rel_err_logits_vs_float64": v.get("max_rel_err_logits_vs_float64")}


def _verify_reference(rt: _Runtime, workload, verification: dict, tie: float) -> dict:
    """The untimed pass's tokens (which every timed pass repeats) against an eager forward
    outside the engine (``bench.token_reference``)."""
    found = token_reference(rt.runner.model, rt.lora, workload, rt.passes[0], tie,
                            engine_logits=rt.logits)
    return judge(found, rt.runner.model, tie, verification)


def _q(xs: list[float], q: float) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[max(0, int(q * 100) - 1)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict]) -> str:
    from bench.table import fmt, render

    head = ["case", "tokens/s", "% of base (bytes floor)", "req/s", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms",
            "step p50 ms: decode/extend", "ms a pass over base: decode/extend",
            "slot writes/pass (ms each)", "steps ahead", "J/token", "status"]
    body = []
    for r in rows:
        d = r["derived"]
        pct = fmt(d.get("pct_of_base"))
        if d.get("pct_of_base_at_floor") is not None:
            pct += f" ({fmt(d['pct_of_base_at_floor'])})"
        body.append([r["label"], fmt(d.get("output_tokens_per_s")), pct,
                     fmt(d.get("requests_per_s"), ".2f"),
                     f"{fmt(d.get('ttft_p50_ms'))} / {fmt(d.get('ttft_p99_ms'))}",
                     f"{fmt(d.get('tpot_p50_ms'), '.2f')} / {fmt(d.get('tpot_p99_ms'), '.2f')}",
                     f"{fmt(d.get('decode_step_ms_p50'), '.2f')} / "
                     f"{fmt(d.get('extend_step_ms_p50'), '.2f')}",
                     f"{fmt(_over_base(d, 'decode'), '.1f')} / "
                     f"{fmt(_over_base(d, 'extend'), '.1f')}",
                     f"{fmt(d.get('slot_writes'))} ({fmt(d.get('slot_write_ms'), '.2f')})",
                     f"{fmt(d.get('ahead_steps'), 'd')} / {fmt(d.get('steps'), 'd')}",
                     fmt(d.get("joules_per_token"), ".3f"), r["verification"]["status"]])
    return render(head, body)


def _over_base(d: dict, mode: str) -> float | None:
    """A LoRA case's pass time in ``mode`` steps over its interleaved base's (ms)."""
    mine, base = d.get(f"{mode}_ms_total"), d.get(f"base_{mode}_ms_total")
    return None if mine is None or base is None else mine - base
