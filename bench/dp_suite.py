"""The DP benchmark (``bench.dp_bench``) as suite "dp" of ``python -m bench``: the selected
cases of one DP size (and model) run in one spawn of that many ranks, started when the first of
them comes up; each case then returns its row. On a GPU each rank needs its own GPU (NCCL
cannot place two ranks on one), so a size above the GPUs present is reported as skipped, with
the reason, not run. A spawn that fails (a rank raised, a collective timed out) makes its
cases failed with the error. The telemetry the runner records for the first case of a size
spans the whole spawn."""

from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path

import torch

from bench import dp_bench
from bench.context import Context
from bench.results import make_row
from bench.scenarios import DPCase
from lora_runtime.dp.launch import spawn

TIMEOUT_S = 120.0


def cases(preset: str, layers: int, dtype: str, sizes, loads, adapters,
          rank: int, workload: dict | None = None) -> list[DPCase]:
    """``workload``: requests_per_rank, prompt, output and max_batch of every case (the
    profile's; default ``DPCase``'s)."""
    return [DPCase(preset, layers, dtype, size, load, a, str(rank) if a else "-",
                   **(workload or {}))
            for size in sizes for a in adapters for load in loads]


def make_runner(todo: list[DPCase], ctx: Context):
    rows: dict[DPCase, dict] = {}

    def run(case: DPCase) -> list[dict]:
        if case not in rows:
            group = [c for c in todo if _spawn_key(c) == _spawn_key(case)]
            rows.update(_run_group(group, ctx))
        return [rows.pop(case)]

    return run


def _spawn_key(c: DPCase) -> tuple:
    """Cases one spawn of ranks runs: one size, model and workload."""
    return (c.dp_size, c.preset, c.layers, c.dtype, *c.workload().values())


def _run_group(group: list[DPCase], ctx: Context) -> dict[DPCase, dict]:
    size = group[0].dp_size
    gpus = torch.cuda.device_count()
    if ctx.device.type == "cuda" and size > gpus:
        why = (f"DP size {size} needs {size} GPUs (one rank per GPU: NCCL cannot place two "
               f"ranks on one GPU); this machine has {gpus}. Run it on a machine with {size} "
               "GPUs, or the DP pipeline on a CPU with --profile cpu (gloo)")
        return _all(group, ctx, "skipped", why)
    opts = {"preset": group[0].preset, "layers": group[0].layers, **group[0].workload(),
            "profile": ctx.profile, "idle_reps": ctx.reps,
            "cases": [{"adapters": c.adapters, "load": c.load,
                       "rank": int(c.ranks) if c.adapters else 0} for c in group]}
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / f"dp{size}.json"
        try:
            spawn(dp_bench.run_rank, size, size, opts, str(part), timeout_s=TIMEOUT_S)
            got = {r["label"]: r for r in json.loads(part.read_text())}
        except Exception as e:  # a failed rank: its cases are failed, the run goes on
            tail = "".join(traceback.format_exception_only(e)).strip()[-2000:]
            return _all(group, ctx, "failed", f"DP size {size} spawn failed: {tail}")
    out = _all([c for c in group if c.label not in got], ctx, "failed",
               "rank 0 returned no row for this case (its fields differ from the case's)")
    return out | {c: got[c.label] for c in group if c.label in got}


def _all(group: list[DPCase], ctx: Context, status: str, error: str) -> dict[DPCase, dict]:
    return {c: make_row(c, ctx.profile, {}, verification={"status": status,
                                                                  "error": error})
            for c in group}


def table(rows: list[dict]) -> str:
    from bench.table import fmt, render

    head = ["case", "tokens/s", "req/s", "idle share per rank",
            "idle forward LoRA / peers / base us",
            "graph steps", "steps ahead", "status"]
    body = []
    for r in rows:
        d = r["derived"]
        shares = d.get("idle_share_per_rank")
        body.append([r["label"], fmt(d.get("output_tokens_per_s")),
                     fmt(d.get("requests_per_s"), ".2f"),
                     "-" if shares is None else " ".join(f"{s:.2f}" for s in shares),
                     f"{fmt(d.get('idle_forward_lora_us'))} / "
                     f"{fmt(d.get('idle_forward_peers_us'))} / "
                     f"{fmt(d.get('idle_forward_base_us'))}",
                     fmt(d.get("graph_steps"), "d"),
                     f"{fmt(d.get('ahead_steps'), 'd')} / {fmt(d.get('steps'), 'd')}",
                     r["verification"]["status"]])
    return render(head, body)
