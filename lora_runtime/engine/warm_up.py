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

Where the adapters include the base model (None) beside adapters, both sweeps run once more
on the base model alone: a step without adapters makes no LoRA launch (contract 6), so its
kernels are not those of any step with adapters.

Under data parallelism every rank serves the same phases, so the gathered MLP rows sweep the
same ladder times the DP size. The ladder's powers of two bound each heuristic from both
sides; a shape between two rungs that flips a heuristic threshold can still compile once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels import jit_watch

if TYPE_CHECKING:
    from lora_runtime.engine.engine import Engine

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
                   adapters: Sequence[str | None], max_positions: int | None = None
                   ) -> list[list[WarmUpRequest]]:
    """The phases (each a list of requests served to completion) for an engine whose steps
    take ``max_step_tokens`` tokens and ``max_batch_size`` requests, whose KV cache holds
    ``kv_tokens``; ``adapters`` cycles over the requests (None: the base model). No request
    reaches past ``max_positions`` positions (the model's rotary table): a step's tokens are
    then spread over more requests."""
    cycle = list(adapters) or [None]
    cap = max_positions or kv_tokens
    phases = []
    for t in ladder(min(max_step_tokens, kv_tokens, max_batch_size * cap)):
        k = min(t, max(len(cycle), -(-t // cap)), max_batch_size)
        lens = [t // k + (1 if i < t % k else 0) for i in range(k)]
        phases.append([WarmUpRequest(n, 1, cycle[i % len(cycle)]) for i, n in enumerate(lens)])
    # A decode step needs a position after the prompt: a model of one position has none
    # (its requests hold one token: prompt 1, max_new_tokens 1).
    for n in ladder(min(max_batch_size, kv_tokens // 2) if cap >= 2 else 0):
        prompt = max(1, min(BATCH_PROMPT, kv_tokens // n - 1, max_step_tokens, cap - 1))
        phases.append([WarmUpRequest(prompt, 2, cycle[i % len(cycle)]) for i in range(n)])
    return phases


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    return [(7 * i + 13 * seed + 3) % vocab for i in range(n)]


def check_warm_up(engine: Engine, adapters: Sequence[str | None] | None
                  ) -> list[str | None]:
    """The adapters ``warm_up`` cycles over; raises where it must not run."""
    if engine.has_work:
        raise RuntimeError("warm_up runs before serving, but the engine has requests; "
                           "call it right after loading the adapters")
    if isinstance(adapters, str):  # would be read one adapter a letter
        raise ValueError(f"warm_up takes a list of adapter names (None: the base model), got "
                         f"the string {adapters!r}: pass [{adapters!r}]")
    if adapters is not None:
        if not isinstance(adapters, Iterable):  # 5 raised "'int' object is not iterable"
            raise ValueError(f"warm_up takes a list of adapter names (None: the base model), "
                             f"got {type(adapters).__name__} {adapters!r:.80}: pass a list, "
                             "e.g. [name, None]")
        # Read once: a generator was used up by the check below, and the warm-up then served
        # the base model alone (none of its adapters' kernel variants compiled).
        adapters = list(adapters)
    else:
        slots = engine.lora.config.max_loras_per_batch if engine.lora is not None else 0
        pinned = set(engine.lora.pool.pinned) if engine.lora is not None else set()
        # Pinned ones first: when they hold every slot, no other adapter could run.
        loaded = sorted(engine.lora.adapters, key=lambda n: (n not in pinned, n)) \
            if engine.lora is not None else []
        adapters = [*loaded[:slots], None]
    for a in adapters:
        if a is not None and not isinstance(a, str):  # a list raised "unhashable type"
            raise ValueError(f"warm_up: adapters holds {type(a).__name__} {a!r:.80}, not an "
                             "adapter's name (str) or None (the base model)")
        if a is not None and (engine.lora is None or a not in engine.lora.adapters):
            raise ValueError(f"warm_up: adapter {a!r} is not loaded; load it first")
    return list(adapters)


def warm_up(engine: Engine, adapters: Sequence[str | None] | None) -> WarmUpReport:
    """``Engine.warm_up``: serves the phases eagerly, then forgets them."""
    adapters = check_warm_up(engine, adapters)
    t0, jit0 = time.perf_counter(), jit_watch.count()
    marks = engine.steps_recorded, len(engine.finished)
    # Its requests' ids are given back too: the first request served after it was numbered
    # past them (18 on a tiny engine) while its step indices started again at 0.
    next_id = next(engine._ids)
    served = list(engine.timeline)  # the warm-up's own steps may trim it (max_timeline)
    vocab = engine.runner.model.config.vocab_size
    limits = (engine.config.max_step_tokens, engine.config.max_batch_size, engine.kv.max_tokens)
    positions = engine.runner.model.config.max_position_embeddings
    phases = warm_up_phases(*limits, adapters, positions)
    if None in adapters and any(a is not None for a in adapters):
        # Every phase above holds an adapter's rows; a step without adapters makes no LoRA
        # launch and runs other kernels (RoPE, SwiGLU, the norm without a LoRA term).
        phases += warm_up_phases(*limits, [None], positions)
    # Eagerly: a captured graph compiled its kernels at capture, and any step (under DP, a
    # step whose ranks disagree on the mode) may run eagerly.
    graphs, engine.graphs = engine.graphs, []
    ids: list[int] = []
    try:
        for i, phase in enumerate(phases):
            for r in phase:
                ids.append(engine.add_request(prompt_ids(r.prompt_len, vocab, i), r.adapter,
                                              max_new_tokens=r.max_new_tokens).id)
            engine.run()
    except BaseException:
        engine._discard_all()  # a failed warm-up leaves no request behind either
        raise
    finally:
        engine.graphs = graphs
        for i in ids:
            engine.logits.pop(i, None)
        steps = engine.steps_recorded - marks[0]
        engine.timeline[:] = served
        del engine.finished[marks[1]:]
        engine.steps_recorded = marks[0]
        engine._ids = itertools.count(next_id)
    jit = jit_watch.count()
    return WarmUpReport(time.perf_counter() - t0, steps,
                        None if jit is None else jit - jit0)
