"""The suites ``python -m bench`` runs, by name. A suite lists its cases for a profile,
prepares what its cases share (``start``, given the selected cases; returns the per-case
function) and prints its table. The serving scenarios' row fields (throughput, idle, dp) are
in ``bench.scenarios``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench import (
    attention_suite,
    base_step_suite,
    dp_suite,
    idle_bench,
    kernel_bench,
    model_bench,
    profiles,
    table,
    throughput_bench,
)
from bench.case import Case
from bench.context import Context


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    cases: Callable[[str], list[Case]]
    start: Callable[[list[Case], Context], Callable[[Case], list[dict]]]
    table: Callable[[list[dict]], str]


def _kernels_start(todo, ctx):
    return lambda case: kernel_bench.run_case(case, ctx)


def _model_start(todo, ctx):
    cache = model_bench.RuntimeCache(todo, ctx.device)
    return lambda case: model_bench.run_case(case, ctx, cache)


SUITES = {
    "kernels": Suite("kernels", "LoRA kernels per module vs torch reference and base GEMM",
                     profiles.kernel_cases, _kernels_start, table.kernel_table),
    "model": Suite("model", "whole-model decode step: eager vs graph, LoRA off/base/LoRA "
                   "traffic, adapters and ranks", profiles.model_cases, _model_start,
                   table.model_table),
    "throughput": Suite("throughput", "the serving engine on offline workloads: tokens/s, "
                        "TTFT/TPOT, J/token, LoRA vs base by adapters and popularity",
                        profiles.throughput_cases,
                        lambda todo, ctx: throughput_bench.make_runner(ctx),
                        throughput_bench.table),
    "idle": Suite("idle", "the idle path: an idle forward and a base-only batch, LoRA runtime "
                  "vs runtime without LoRA, eager and graph", profiles.idle_cases,
                  idle_bench.make_runner, idle_bench.table),
    "dp": Suite("dp", "data-parallel attention: DP sizes, balanced and skewed load, with and "
                "without LoRA: tokens/s, idle share per rank, idle forward cost",
                profiles.dp_cases, dp_suite.make_runner, dp_suite.table),
    "base_step": Suite("base_step", "the base model's decode step (graph replay, no LoRA) by "
                       "batch size and context vs its bytes and roofline floors",
                       profiles.base_step_cases, base_step_suite.make_runner,
                       base_step_suite.table),
    "attention": Suite("attention", "attention over the KV cache, decode and prefill: Triton "
                       "kernels and the torch reference vs their bytes/FLOP floors",
                       profiles.attention_cases,
                       lambda todo, ctx: lambda case: attention_suite.run_case(case, ctx),
                       attention_suite.table),
}
