"""The benchmarks' rows against the float64 model written from the definition
(``bench.float64_model``): the base step's decode rows, and the model suite's LoRA rows run
alone from scratch. What is judged per dtype is ``ROW_TOL`` on a row's relative error, and in
fp32 also ``TERM_TOL_FP32`` on the LoRA term's."""

from __future__ import annotations

import torch

from bench.float64_model import Probe, last_logits_f64

ROW_TOL = {torch.float32: 1e-4, torch.float16: 0.25, torch.bfloat16: 0.25}
"""A checked row's relative error against float64. fp32: a correct runtime measures ~1e-6
(CPU profile). bf16: measured on a CPU (torch matmuls; hidden 1024, Llama-3 rotary, context
512, base model): 0.011 / 0.015 / 0.024 at 2 / 4 / 8 layers, growing like sqrt(layers), so
~0.05 at 32; RMSNorm eps x100 measured 0.67-0.78 and a RoPE base x2 0.89-1.0 at 4 layers.
With 4 rank-16 adapters (the LoRA term 87% of the logits' norm) a correct bf16 row measured
0.013, a dropped o_proj term 0.48-0.53 and a dropped v slice 0.37-0.55 (4 layers). The bound
sits between (fp16 takes it too); on a GPU it is not yet measured, and each row records its
error."""
TERM_TOL_FP32 = 1e-3
"""fp32: the LoRA term's relative error, ``|got - ref| / |ref - base|``. A correct runtime
measured 3e-7 to 8e-7 on the CPU profile (the term is 40-95% of the logits' norm there); a
scaling 2% off measured 2e-2. In bf16 the runtime's own rounding is a large share of the
term, so there it is recorded (``max_rel_err_lora_term_vs_float64``), not judged: on a CPU
a correct bf16 runtime measured 0.015, a scaling 2% off 0.028 (4 layers, hidden 1024)."""
ALL_ROWS = 8
"""Batches of up to this many requests have every row checked; a larger one this many rows
(the first, middle and last, the rest spread evenly). With three picked rows, a fault
confined to a request between them (positions off for the third request of 4) was verified on
the CPU profile, whose batches hold 1-4 requests. The model suite's batches have the first
request of every distinct adapter checked too (beyond this many where there are more
adapters): the first of 4 adapters left a fault of one adapter alone (its o_proj term
dropped) verified in a batch of 16 over 8 adapters."""
PROBES_AT_ONCE = 16
"""Requests run through the float64 model in one forward (its activations' memory)."""
DECODE_CHECK = (f"every request (over {ALL_ROWS}: {ALL_ROWS} spread) == a float64 decode "
                "step from the definition")
LORA_CHECK = "eager == each request alone through a float64 model with its adapter"


def check_decode_rows(model, kv, requests, got: torch.Tensor, dtype, what: str) -> float:
    """Rows of ``got`` (the runtime's logits of the decode step of ``requests``; every row up
    to ``ALL_ROWS``, else the first, middle, last and rows between) against the float64 model
    reading their cached context; raises ``AssertionError`` past ``ROW_TOL``. Returns the
    worst row's error."""
    picks = _spread(len(requests), {0, len(requests) // 2, len(requests) - 1})
    probes = [Probe((requests[i].last_token,), tuple(requests[i].kv_slots[:-1]))
              for i in picks]
    err = _row_errors(got[picks], last_logits_f64(model, probes, kv))
    _judge(err, picks, ROW_TOL[dtype], what, "a float64 decode step from the definition")
    return max(err)


def check_lora_rows(model, adapters: dict, got: torch.Tensor, requests, dtype,
                    what: str) -> dict:
    """Rows of ``got`` (the runtime's logits at each request's last token) against each
    request run alone from scratch through the float64 model with its adapter (``adapters``:
    name -> host ``LoRAAdapter``). Raises ``AssertionError`` past the limits."""
    picks = _lora_picks([r.adapter for r in requests])
    tokens = [tuple(requests[i].prompt) + tuple(requests[i].output) for i in picks]
    ref = _in_chunks(model, [Probe(t, (), adapters.get(requests[i].adapter))
                             for t, i in zip(tokens, picks, strict=True)])
    lora = [j for j, i in enumerate(picks) if requests[i].adapter is not None]
    base = ref.clone()  # the LoRA rows' base logits: a second forward for those rows only
    if lora:
        base[lora] = _in_chunks(model, [Probe(tokens[j]) for j in lora])
    rows = got[picks].double()
    err = _row_errors(rows, ref)
    _judge(err, picks, ROW_TOL[dtype], what, "a float64 model with its adapter")
    term = (ref - base).norm(dim=-1)
    term_err = [((rows[j] - ref[j]).norm() / term[j].clamp_min(1e-30)).item() for j in lora]
    if dtype == torch.float32:
        _judge(term_err, [picks[j] for j in lora], TERM_TOL_FP32, what,
               "a float64 model with its adapter (the LoRA term's relative error)")
    return {"max_rel_err_vs_float64": max(err),
            "max_rel_err_lora_term_vs_float64": max(term_err, default=0.0),
            "lora_term_rel_size": max((term[j] / base[j].norm()).item() for j in lora)
            if lora else 0.0}


def _in_chunks(model, probes: list[Probe]) -> torch.Tensor:
    return torch.cat([last_logits_f64(model, probes[i : i + PROBES_AT_ONCE])
                      for i in range(0, len(probes), PROBES_AT_ONCE)])


def _lora_picks(names) -> list[int]:
    """``_spread``'s rows, the first request of every distinct adapter among them."""
    if not names:
        return []
    first: dict = {}
    for i, n in enumerate(names):
        first.setdefault(n, i)
    return _spread(len(names), {*first.values(), len(names) // 2, len(names) - 1})


def _spread(n: int, must: set[int]) -> list[int]:
    """Every row of ``n`` if ``n <= ALL_ROWS``, else ``must`` and rows spread evenly up to
    ``ALL_ROWS`` in all."""
    if n <= ALL_ROWS:
        return list(range(n))
    rows = set(must)
    spread = [round(j * (n - 1) / (ALL_ROWS - 1)) for j in range(ALL_ROWS)]
    for i in [*spread, *range(n)]:
        if len(rows) >= ALL_ROWS:
            break
        rows.add(i)
    return sorted(rows)


def _row_errors(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    got = got.double()
    return ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).tolist()


def _judge(errors, requests, tol: float, what: str, against: str) -> None:
    bad = {i: round(e, 6) for i, e in zip(requests, errors, strict=True) if not e <= tol}
    if bad:
        raise AssertionError(f"{what}: requests {bad} differ from {against} by more than "
                             f"{tol} (relative)")
