"""The attention benchmark (``bench.attention_bench``) as suite "attention" of ``python -m
bench``: decode and prefill over the token-slot KV cache, the Triton kernels and the torch
reference, each case checked against the fp32 reference before it is timed (failed and not
timed when off); rows carry the floors (bytes, FLOPs) and ``x_floor``."""

from __future__ import annotations

from bench import attention_bench
from bench.attention_bench import AttentionCase
from bench.context import Context
from bench.results import make_row


def run_case(case: AttentionCase, ctx: Context) -> list[dict]:
    if attention_bench.torch_reference_too_large(case):
        return [make_row(case, ctx.profile, {}, verification={
            "status": "skipped", "error": "the torch reference's temporaries exceed "
            f"{attention_bench.TORCH_REF_MAX_BYTES >> 30} GiB"})]
    try:
        t, derived = attention_bench.measure_case(case, ctx.device, ctx.ceilings, ctx.reps)
    except AssertionError as e:
        return [make_row(case, ctx.profile, {}, verification={"status": "failed",
                                                              "error": str(e)})]
    return [make_row(case, ctx.profile, {}, timing=t, derived=derived, verification={
        "status": "verified", "error": None, "rel_err_vs_fp32_reference": derived["rel_err"],
        "checks": [f"requests {', '.join(map(str, attention_bench.checked_requests(case)))} "
                   "vs the fp32 torch reference"]})]


def table(rows: list[dict]) -> str:
    from bench.table import fmt, render

    head = ["case", "us", "floor us", "x floor", "GB/s", "rel err", "status"]
    body = []
    for r in rows:
        d, s = r["derived"], r.get("stats") or {}
        body.append([r["label"], fmt(s.get("median_us")), fmt(d.get("floor_us")),
                     fmt(d.get("x_floor"), ".2f"), fmt(d.get("gbps"), ".0f"),
                     fmt(d.get("rel_err"), ".1e"), r["verification"]["status"]])
    return render(head, body)
