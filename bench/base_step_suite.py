"""Suite "base_step" of ``python -m bench``: the base model's decode step (no LoRA, CUDA-graph
replay only) by batch size and context, with the Triton kernels and with the torch reference,
next to its floors (``bench.step_floor``). Before it is timed, each replay is checked against
an eager forward of the same batch and, for three of its requests, against the float64 model
written from the definition (``bench.reference_checks``): failed, and not timed, when they
differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.case import Case
from bench.context import Context
from bench.logits_match import assert_logits_match
from bench.reference_checks import DECODE_CHECK, check_decode_rows
from bench.results import make_row
from bench.step_floor import StepFloor
from bench.timing import bench_time
from graphs import GraphRunner
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class BaseStepCase(Case):
    suite = "base_step"
    preset: str
    layers: int
    dtype: str
    batch_size: int
    context: int
    kernels: str
    """triton | torch (``lora_runtime.model.backend``)."""

    @property
    def label(self) -> str:
        return (f"base_step {self.preset} L={self.layers} bs={self.batch_size} "
                f"ctx={self.context} {self.kernels}")


def cases(preset: str, layers: int, dtype: str, batch_sizes, contexts, kernels=("triton",)):
    return [BaseStepCase(preset, layers, dtype, bs, c, k)
            for c in contexts for k in kernels for bs in batch_sizes]


def decode_batch(kv: KVCache, bs: int, context: int, device):
    """``bs`` requests each decoding their ``context``-th token (slots taken from ``kv``)."""
    reqs = [Request([1] * context, None, 4) for _ in range(bs)]
    for r in reqs:
        r.kv_slots = kv.alloc(context - 1)
    return reqs, build_decode(reqs, kv, device)


def ragged_batch(kv: KVCache, bs: int, context: int, vocab: int, device):
    """A verification batch of the bucket ``bs`` that the timed one is not: contexts from
    ``context`` down to ``context // bs`` (unequal: padded attention tables, other
    positions) and last tokens spread down from the highest id (the timed batch has one
    context length and token 1 everywhere)."""
    lens = [max(2, context - i * (context // bs)) for i in range(bs)]
    reqs = [Request([1] * (n - 1) + [vocab - 1 - (i * vocab) // bs], None, 4)
            for i, n in enumerate(lens)]
    for r in reqs:
        r.kv_slots = kv.alloc(len(r.prompt) - 1)
    return reqs, build_decode(reqs, kv, device)


class _Runtimes:
    """One model, KV cache and set of decode graphs per (preset, layers, dtype), reused by the
    cases that share them; graphs per (context, kernels) capture every selected batch size."""

    def __init__(self, todo: list[BaseStepCase], device: torch.device) -> None:
        self.todo, self.device, self.key, self.graphs = todo, device, None, {}

    def get(self, case: BaseStepCase):
        key = (case.preset, case.layers, case.dtype)
        if key != self.key:
            self.key, self.graphs = None, {}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            mine = [c for c in self.todo if (c.preset, c.layers, c.dtype) == key]
            config = PRESETS[case.preset](case.layers)
            dtype = getattr(torch, case.dtype)
            self.model = LlamaForCausalLM.random(config, dtype, self.device)
            self.kv = KVCache(config, max(c.batch_size * c.context for c in mine) + 8, dtype,
                              self.device)
            for cache in self.kv.k + self.kv.v:  # random, not zeros: zeros can run faster
                cache.normal_()
            self.runner, self.key, self.floor = ModelRunner(self.model, self.kv, None), key, \
                StepFloor.of(self.model)
        gkey = (case.context, case.kernels)
        if gkey not in self.graphs:
            self.graphs.clear()
            sizes = sorted({c.batch_size for c in self.todo
                            if (c.preset, c.layers, c.dtype, c.context, c.kernels)
                            == (*key, *gkey)})
            with use_base_backend(case.kernels):
                self.graphs[gkey] = GraphRunner.decode(self.runner, sizes,
                                                       case.context + 8).capture()
        return self.graphs[gkey]


def make_runner(todo: list[BaseStepCase], ctx: Context):
    runtimes = _Runtimes(todo, ctx.device)

    def run(case: BaseStepCase) -> list[dict]:
        graphs = runtimes.get(case)
        kv, dtype = runtimes.kv, getattr(torch, case.dtype)
        reqs, batch = ragged_batch(kv, case.batch_size, case.context,
                                   runtimes.model.config.vocab_size, ctx.device)
        try:  # not timed: verified like the timed batch below
            got = graphs.replay(batch).clone()
            with use_base_backend(case.kernels):
                want = runtimes.runner.forward_eager(batch)
            assert_logits_match(got, want, dtype, "ragged batch: graph replay vs eager",
                                case.layers)
            ragged_err = check_decode_rows(runtimes.model, kv, reqs, got, dtype,
                                           f"{case.label}: graph replay of a ragged batch")
        except AssertionError as e:
            return [make_row(case, ctx.profile, {}, verification={"status": "failed",
                                                                  "error": str(e)})]
        finally:
            kv.free([s for r in reqs for s in r.kv_slots])
        reqs, batch = decode_batch(kv, case.batch_size, case.context, ctx.device)
        try:  # freed whatever happens: the run goes on to the next case of this cache
            got = graphs.replay(batch).clone()
            with use_base_backend(case.kernels):
                want = runtimes.runner.forward_eager(batch)
            err = assert_logits_match(got, want, dtype, "graph replay vs eager",
                                      case.layers)
            ref_err = check_decode_rows(runtimes.model, kv, reqs, got, dtype,
                                        f"{case.label}: graph replay")
            replay = graphs.graphs[(graphs.last_kind, graphs.buffers.bucket_for(batch))].replay
            t = bench_time(replay, device=ctx.device, mode="events", reps=ctx.reps, warmup=3)
        except AssertionError as e:
            return [make_row(case, ctx.profile, {}, verification={"status": "failed",
                                                                  "error": str(e)})]
        finally:
            kv.free([s for r in reqs for s in r.kv_slots])
        f = runtimes.floor.us(case.batch_size, case.context, ctx.ceilings)
        derived = {**f, "floor_bytes": runtimes.floor.bytes(case.batch_size, case.context),
                   "pct_of_bytes_floor": 100 * f["bytes_floor_us"] / t.median_us,
                   "pct_of_roofline": 100 * f["roofline_floor_us"] / t.median_us,
                   "x_floor": t.median_us / f["roofline_floor_us"]}
        return [make_row(case, ctx.profile, {}, timing=t, derived=derived, verification={
            "status": "verified", "error": None, "replay_vs_eager_err": err,
            "max_rel_err_vs_float64": ref_err, "ragged_max_rel_err_vs_float64": ragged_err,
            "checks": ["graph replay vs eager forward of the same batch",
                       DECODE_CHECK, f"a ragged batch (unequal contexts, high token ids): "
                       f"replay == eager, {DECODE_CHECK}"]})]

    return run


def table(rows: list[dict]) -> str:
    from bench.table import fmt, render

    head = ["case", "step us", "bytes floor us", "% of it", "roofline us", "% of it", "status"]
    body = [[r["label"], fmt((r.get("stats") or {}).get("median_us"), ".0f"),
             fmt(r["derived"].get("bytes_floor_us"), ".0f"),
             fmt(r["derived"].get("pct_of_bytes_floor"), ".0f"),
             fmt(r["derived"].get("roofline_floor_us"), ".0f"),
             fmt(r["derived"].get("pct_of_roofline"), ".0f"), r["verification"]["status"]]
            for r in rows]
    return render(head, body)
