"""An engine's tokens against an eager forward outside the engine.

The throughput and DP suites otherwise compare the engine with itself (timed passes with the
untimed pass, a token count), so a deterministic fault (a step's tokens given to the wrong
requests, DP rows gathered out of order) is verified and its tokens/s published. Here each
of the first requests is prefilled again, alone with a few others, through the plain model
runner: the greedy token there must be the engine's, except at a near-tie."""

from __future__ import annotations

from typing import NamedTuple

import torch

from bench.float64_model import Probe, last_logits_f64
from bench.reference_checks import ROW_TOL
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend

TIE = 0.125
"""bf16/fp16: the near-tie margin (logit units) within which a token may differ between two
paths (fp32 atomics in another order move bf16 logits by an ulp)."""
TIE_FP32 = 1e-3
"""fp32 (the CPU profile): the paths round only slightly differently. 0.125 there excused
nearly every token of the tiny model, whose top-2 margins are mostly below it."""
REQUESTS = 16
"""Requests whose tokens are recomputed (the first ones of the workload)."""
CHUNK = 8
"""Requests per reference forward."""
SHARE_BF16 = 1 / 8
"""bf16/fp16: the share of probes that may differ past the near-tie. Two equally accurate
bf16 paths can flip a token past 0.1 on an ill-conditioned row (seen on the H200 with rank
64-128 adapters); a structural fault moves most probes. fp32 allows none."""
CHECK = (f"first and last tokens of the first {REQUESTS} requests == an eager forward outside "
         "the engine")
ROW_TOL_FP32 = 1e-4
"""fp32: the relative error of the engine's logits row at a probe (``Engine(keep_logits=True)``)
against the reference's. A token can only show a fault that moves a top-2 margin past the near
tie: padding rows writing their K/V into a request's slot, or one request decoding a position
off, were verified with every probed token right. A correct engine measured ~1e-6 on the CPU
profile. bf16/fp16: recorded (``max_rel_err_logits_vs_eager``), not judged (unmeasured on a
GPU)."""
LOGITS_CHECK = f"logits rows at those tokens == the eager forward's (fp32: {ROW_TOL_FP32})"
FLOAT64_CHECK = ("logits rows at those tokens == a float64 model with the request's adapter "
                 "(bench.reference_checks.ROW_TOL)")
"""The eager forward runs the runtime's own LoRA manager (its slots, images, kernels): a fault
there (one adapter's o_proj term dropped at its slot write) is in the reference too, and was
verified. The float64 model shares only the weights and the host adapters."""


class Found(NamedTuple):
    """What ``token_reference`` found."""

    bad: list
    """(request, token, reference token, engine token) past the near-tie."""
    probes: int
    row_errors: list | None = None
    """(request, token, relative error of the engine's logits row against the reference's)
    per probe, when the engine's rows were given."""
    float64_errors: tuple = ()
    """(request, token, relative error of the engine's row, else the eager one's, against the
    float64 model with the request's adapter) per probe."""


def near_tie(dtype: str) -> float:
    return TIE_FP32 if dtype == "float32" else TIE


def token_reference(model, lora, workload, outs, tie: float,
                    indices=None, engine_logits=None) -> Found:
    """For each of the first ``REQUESTS`` requests, its prompt and the tokens before its first
    and last output token, prefilled by an eager forward of ``model`` (with ``lora``): the
    greedy token there must be the one the engine gave that request (``outs[i]``), except
    where the engine's token scores within ``tie`` of it in the reference (a near-tie). The
    engine's scheduling, overlap, graph replays, DP collectives and the assignment of a
    step's tokens to requests are not on this path.
    ``indices``: the requests to probe instead of the first ``REQUESTS`` (DP: some of every
    rank's). ``engine_logits`` (request -> the engine's logits row at each output token):
    each probe's row is compared too."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    probes = []  # (request, position in its output)
    for i in range(min(REQUESTS, len(outs))) if indices is None else indices:
        if outs[i]:
            probes += [(i, k) for k in sorted({0, len(outs[i]) - 1})]
    bad, row_errors, float64_errors = [], None if engine_logits is None else [], []
    hosts = {} if lora is None else lora.adapters
    try:
        for chunk in _chunks(probes, workload, lora):
            reqs = [Request(list(workload[i].prompt) + outs[i][:k], workload[i].adapter, 1)
                    for i, k in chunk]
            kv = KVCache(model.config, sum(len(r.prompt) for r in reqs) + 8, dtype, device)
            logits = ModelRunner(model, kv, lora).forward_eager(
                build_extend(reqs, kv, device)).float()
            exact = last_logits_f64(model, [Probe(tuple(r.prompt), (), hosts.get(r.adapter))
                                            for r in reqs])
            best = logits.max(dim=-1)
            for row, (i, k) in enumerate(chunk):
                eng = logits[row] if engine_logits is None else engine_logits[i][k].float()
                float64_errors.append((i, k, _relative(eng, exact[row])))
                if row_errors is not None:
                    row_errors.append((i, k, _relative(eng, logits[row])))
                # The engine's token must itself be within ``tie`` of the reference's best: a
                # near-tie between the reference's top two excuses those two tokens, not any.
                tok, top = outs[i][k], int(best.indices[row])
                if tok == top:
                    continue
                if not 0 <= tok < logits.shape[-1] or float(
                        best.values[row] - logits[row, tok]) > tie:
                    bad.append((i, k, top, tok))
    finally:
        if lora is not None:
            lora.reset_lora_batch()
    return Found(bad, len(probes), row_errors, tuple(float64_errors))


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def judge(found: Found, model, tie: float, verification: dict, check: str = CHECK) -> dict:
    """``verification`` with the reference's outcome (``found``: ``token_reference``'s)."""
    bad, probes, row_errors = found.bad, found.probes, found.row_errors
    dtype = next(model.parameters()).dtype
    fp32 = dtype == torch.float32
    allowed = 0 if fp32 else int(probes * SHARE_BF16)
    if len(bad) > allowed:
        return {"status": "failed",
                "error": f"(request, token, reference token, engine token) {bad[:5]}: "
                         f"{len(bad)} of {probes} tokens differ from an eager forward of the "
                         f"request's prompt and earlier tokens where the top-2 margin exceeds "
                         f"{tie} (at most {allowed} may)"}
    extra, checks = {}, [check]
    if row_errors is not None:
        far = [(i, k, round(e, 6)) for i, k, e in row_errors if not e <= ROW_TOL_FP32]
        if fp32 and far:
            return {"status": "failed",
                    "error": f"(request, token, relative error) {far[:5]}: {len(far)} of "
                             f"{len(row_errors)} of the engine's logits rows differ from an "
                             f"eager forward of the request's prompt and earlier tokens by "
                             f"more than {ROW_TOL_FP32}"}
        extra["max_rel_err_logits_vs_eager"] = max((e for *_, e in row_errors), default=0.0)
        if fp32:
            checks.append(LOGITS_CHECK)
    if found.float64_errors:
        tol = ROW_TOL[dtype]
        far = [(i, k, round(e, 6)) for i, k, e in found.float64_errors if not e <= tol]
        if far:
            return {"status": "failed",
                    "error": f"(request, token, relative error) {far[:5]}: {len(far)} of "
                             f"{len(found.float64_errors)} logits rows differ from a float64 "
                             f"model with the request's adapter by more than {tol}"}
        extra["max_rel_err_logits_vs_float64"] = max(e for *_, e in found.float64_errors)
        checks.append(FLOAT64_CHECK)
    return {**verification, "reference_probes": probes, "reference_mismatches": len(bad),
            **extra, "checks": [*verification.get("checks", []), *checks]}


def _chunks(probes, workload, lora) -> list[list]:
    """``probes`` in batches of at most ``CHUNK`` requests and as many distinct adapters as
    the slots hold."""
    limit = lora.config.max_loras_per_batch if lora is not None else CHUNK
    chunks, names = [[]], set()
    for i, k in probes:
        a = workload[i].adapter
        if chunks[-1] and (len(chunks[-1]) == CHUNK
                           or (a is not None and a not in names and len(names) == limit)):
            chunks.append([])
            names = set()
        chunks[-1].append((i, k))
        if a is not None:
            names.add(a)
    return [c for c in chunks if c]
