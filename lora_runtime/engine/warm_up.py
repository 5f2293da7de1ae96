"""The warm-up workload: synthetic requests whose steps reach the kernel variants a server's
eager steps meet, so none compiles while serving (``kernels.jit_watch`` says why that
matters: a compile stalls the step by up to a second, and under data parallelism every rank).

Which variant a launch takes depends on its shapes: the step's token count (LoRA launch
heuristics split K and tile the output by the number of row blocks), its mode (decode and
extend layouts differ) and, for decode attention, whether the context is split. Two sweeps
cover them, each phase served eagerly (graphs compiled their kernels at capture) to
completion before the next:

- tokens: one prefill step of T tokens, T = 1, 2, 4, ... up to the step budget, shared by a
  few requests on different adapters and the base model (several LoRA segments);
- batch: n requests (n = 1, 2, 4, ... up to the batch limit) with prompts long enough to
  split decode attention's context, then one decode step of n rows.

Under data parallelism every rank serves the same phases, so the gathered MLP rows sweep the
same ladder times the DP size. The ladder's powers of two bound each heuristic from both
sides; a shape between two rungs that flips a heuristic threshold can still compile once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BATCH_PROMPT = 130
"""Prompt length of the batch sweep: past two 64-key tiles, so small decode batches split
their context (decode attention's merge variant) and large ones do not."""


@dataclass(frozen=True)
class WarmUpRequest:
    prompt_len: int
    max_new_tokens: int
    adapter: str | None


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    steps: int
    compiles: int | None
    """Kernel variants compiled (None: not observable)."""


def ladder(top: int) -> list[int]:
    """1, 2, 4, ... below ``top``, then ``top``."""
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top] if top >= 1 else out


def warm_up_phases(max_step_tokens: int, max_batch_size: int, kv_tokens: int,
                   adapters: Sequence[str | None]) -> list[list[WarmUpRequest]]:
    """The phases (each a list of requests served to completion) for an engine whose steps
    take ``max_step_tokens`` tokens and ``max_batch_size`` requests, whose KV cache holds
    ``kv_tokens``; ``adapters`` cycles over the requests (None: the base model)."""
    cycle = list(adapters) or [None]
    phases = []
    for t in ladder(min(max_step_tokens, kv_tokens)):
        k = min(t, len(cycle), max_batch_size)
        lens = [t // k + (1 if i < t % k else 0) for i in range(k)]
        phases.append([WarmUpRequest(n, 1, cycle[i]) for i, n in enumerate(lens)])
    for n in ladder(min(max_batch_size, kv_tokens // 2)):
        prompt = max(1, min(BATCH_PROMPT, kv_tokens // n - 1, max_step_tokens))
        phases.append([WarmUpRequest(prompt, 2, cycle[i % len(cycle)]) for i in range(n)])
    return phases


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    return [(7 * i + 13 * seed + 3) % vocab for i in range(n)]
