"""Cases and row fields of the serving scenarios (throughput, idle path, data parallelism),
run by ``bench.throughput_bench``, ``bench.idle_bench`` and ``bench.dp_bench`` (through
``bench.dp_suite``) and drawn by the report. Rows are made with
``bench.results.make_row(case, profile, variant, timing=..., derived=..., verification=...)``
like every suite's, so they carry the case fields below as their key and the usual stats,
telemetry and verification.

throughput (``ThroughputCase``; variant ``{}``; ``timing``: the timed passes' wall times)
    derived: ``output_tokens_per_s``, ``requests_per_s``, ``ttft_p50_ms``, ``ttft_p99_ms``,
    ``tpot_p50_ms``, ``tpot_p99_ms``, ``output_tokens``, ``duration_s`` (of the median pass),
    ``pass_energy_j`` and ``joules_per_token`` (the median pass's own energy, from
    ``ctx.telemetry.span()`` around it, / ``output_tokens``; null without NVML; the row's
    ``telemetry`` spans the whole case: warm-up, captures and every pass),
    ``pct_of_base`` (with LoRA: the median over the timed passes of each pass's output
    tokens/s as % of the base runtime's pass run just before it, inside the same case;
    ``pct_of_base_pairs`` holds them).
idle (``IdleCase``; variant ``{"runtime": "lora"|"no_lora", "path": "eager"|"graph"}``;
    ``timing``: the forward's time)
    derived: ``overhead_pct`` (over the ``no_lora`` row of the same case and path; null on
    ``no_lora`` rows), ``graph_kind``, ``tokens``, ``floor_us`` / ``x_floor`` (the weight
    matrices read whole, not the embedding table; absent on the eager idle forward, which
    reads no weight).
dp (``DPCase``; variant ``{}``; ``timing``: step times of rank 0)
    derived: ``output_tokens_per_s``, ``requests_per_s``, ``idle_share`` (mean over ranks of
    the share of step time spent in idle forwards), ``idle_share_per_rank`` (list),
    ``idle_forward_us`` (one idle forward in the variant an idle rank replays: ``peers`` with
    LoRA, else ``base``; ``idle_forward_lora_us``, ``idle_forward_peers_us`` and
    ``idle_forward_base_us`` per variant), ``ranks_run_on`` (GPUs used), ``workload``
    (``requests_per_rank`` and the case's total ``requests``: weak scaling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.case import Case

DP_WORKLOAD = ("requests_per_rank", "prompt", "output", "max_batch")


@dataclass(frozen=True)
class ThroughputCase(Case):
    suite = "throughput"
    preset: str
    layers: int
    dtype: str
    workload: str
    """``inP-outO``: prompts of P tokens, O output tokens each (the only form parsed)."""
    requests: int
    adapters: int
    """0: the base model in a runtime without LoRA."""
    popularity: str
    """identical | uniform | zipf | distinct ("-" for adapters=0)."""
    ranks: str

    @property
    def label(self) -> str:
        lora = f"adapters={self.adapters} {self.popularity} r={self.ranks}" if self.adapters \
            else "base"
        return (f"throughput {self.preset} L={self.layers} {self.workload} "
                f"requests={self.requests} {lora}")


@dataclass(frozen=True)
class IdleCase(Case):
    suite = "idle"
    preset: str
    layers: int
    dtype: str
    scenario: str
    """idle_forward (a DP rank without tokens) | base_batch (base-only traffic)."""
    batch_size: int
    """0 for idle_forward."""
    context: int = 0
    """base_batch: tokens cached per request (0 for idle_forward)."""
    adapters: int = 4
    """Adapters loaded in the LoRA runtime (the traffic itself is base-only)."""
    rank: int = 16

    @property
    def label(self) -> str:
        lora = f"adapters={self.adapters} r={self.rank}"
        if self.scenario == "idle_forward":
            return f"idle {self.scenario} {self.preset} L={self.layers} {lora}"
        return (f"idle {self.scenario} {self.preset} L={self.layers} ctx={self.context} "
                f"bs={self.batch_size} {lora}")


@dataclass(frozen=True)
class DPCase(Case):
    suite = "dp"
    preset: str
    layers: int
    dtype: str
    dp_size: int
    load: str
    """balanced | skewed (e.g. all requests on rank 0)."""
    adapters: int
    """0: no LoRA."""
    ranks: str
    requests_per_rank: int = 64
    """The workload (the gpu profile's by default): requests per rank (a case of size N serves
    N times this), prompt and output lengths, the engine's batch limit, and whether it
    overlapped its steps (``dp_bench --serial``: False)."""
    prompt: int = 128
    output: int = 64
    max_batch: int = 32
    overlap: bool = True

    def workload(self) -> dict:
        """The fields ``bench.dp_bench`` serves a case with (its ``opts``)."""
        return {k: getattr(self, k) for k in (*DP_WORKLOAD, "overlap")}

    @property
    def label(self) -> str:
        lora = f"adapters={self.adapters} r={self.ranks}" if self.adapters else "no-lora"
        return (f"dp size={self.dp_size} {self.load} {self.preset} L={self.layers} {lora}"
                + self.workload_suffix())

    def workload_suffix(self) -> str:
        return dp_workload_suffix(self.workload())


def dp_workload_suffix(workload: dict) -> str:
    """A DP label's tail: the workload fields that differ from the gpu profile's (``DPCase``'s
    defaults), so rows of two workloads in one results file never read alike; the default's
    labels are unchanged."""
    default = {f.name: f.default for f in dataclasses.fields(DPCase)}
    short = {"requests_per_rank": "req/rank", "prompt": "prompt", "output": "out",
             "max_batch": "batch"}
    return "".join(f" {short[k]}={v}" if k in short else (" serial" if v is False else "")
                   for k, v in workload.items() if k in default and v != default[k])
