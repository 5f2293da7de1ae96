"""What every rank agrees on before a DP step, in one all-gather of a small int tensor on the
host (gloo) group: each rank's mode, rows, requests (adapter id and rows each), the smallest
graph bucket its batch fits, the adapters its running requests hold, a digest of its loaded
and pinned adapters, whether it has work and whether it may launch its next step ahead. Every
rank then derives the same decision from the same data: the mode, the rows per rank (the size
of the gathered buffer), graph or eager, the bucket (the one that fits the largest rank), the
graph variant (with LoRA when any rank's rows have an adapter, so every rank's gathered MLP runs
the same collectives) and whether every rank launches the next step ahead (only where all
may: a rank running ahead alone would enter the next agreement while another returned from
``step()``, and pair it with a different collective).

Every host collective of a ``DPEngine`` after its set-up check goes through ``HostExchange``:
the same number of ints on every call, after a tag naming the call, so a rank in another call
(a control method called on some ranks only) raises on every rank naming each rank's call,
instead of pairing collectives of other sizes (gloo aborts the process) or reading another
call's ints as its own."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lora_runtime.dp.group import DPGroup, exchange_through_store, mark_fault
from lora_runtime.engine.forward_batch import ForwardMode

NO_GRAPH = -1
_MODES = (ForwardMode.IDLE, ForwardMode.DECODE, ForwardMode.EXTEND)
_HEADER = 9


@dataclass(frozen=True)
class RankStep:
    mode: ForwardMode
    adapters: tuple[int, ...]
    """Adapter id of each request of the step (-1: the base model)."""
    lens: tuple[int, ...]
    """Rows of each request of the step."""
    bucket: int
    """Smallest graph bucket the batch fits (0 when idle: any; NO_GRAPH: none)."""
    running_adapters: tuple[int, ...]
    """Adapters of every running request (they keep slots beyond this step)."""
    pool_digest: int
    has_work: bool
    may_run_ahead: bool = False
    """This rank could launch the step after this one before reading its tokens
    (``Engine._may_run_ahead``; False without overlap)."""
    starved: int = 0
    """Steps this rank's oldest request has waited past ``max_overtake_steps`` for an adapter
    slot (``Scheduler.starved_of_slot``; 0: none)."""

    @property
    def rows(self) -> int:
        return sum(self.lens)


@dataclass(frozen=True)
class StepAgreement:
    ranks: tuple[RankStep, ...]
    mode: ForwardMode
    """IDLE when no rank has rows (nothing runs)."""
    rows_per_rank: int
    use_graph: bool
    bucket: int | None
    lora: bool
    """Replay the LoRA variant (some rank's rows have an adapter)."""
    run_ahead: bool = False
    """Every rank launches the next step before reading this one's tokens."""

    @property
    def has_work(self) -> bool:
        return any(r.has_work for r in self.ranks)

    @property
    def running_adapters(self) -> set[int]:
        return {a for r in self.ranks for a in r.running_adapters}


def pool_digest(loaded: Sequence[str], fingerprints: Sequence[int] = (),
                pinned: Sequence[str] = ()) -> int:
    """A digest of the loaded adapters' names (sorted: they number the agreement's adapter
    ids), of their weights' fingerprints (one name may not stand for other weights on another
    rank) and of the pinned names (sorted: a pin on one rank leaves its slots and admissions
    apart from the others', and the union its peers admit then fails to fit on that rank
    alone, mid-step) that is the same in every process (``hash`` is not). Not of which slot
    holds which adapter: each rank maps the gathered rows' adapter names to its own slots, so
    placements may differ, and a pin made and undone on one rank left its adapter in a slot
    there alone: every later step was refused, for good."""
    text = ("\x1f".join(loaded) + "\x1e" + "\x1f".join(map(str, fingerprints)) + "\x1e"
            + "\x1f".join(pinned))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def decide(ranks: tuple[RankStep, ...]) -> StepAgreement:
    active = [r for r in ranks if r.mode is not ForwardMode.IDLE]
    if not active:
        return StepAgreement(ranks, ForwardMode.IDLE, 0, False, None, False)
    modes = {r.mode for r in active}
    mode = modes.pop() if len(modes) == 1 else ForwardMode.EXTEND
    use_graph = len({r.mode for r in active}) == 1 and all(r.bucket != NO_GRAPH for r in ranks)
    bucket = max(r.bucket for r in ranks) if use_graph else None
    rows = bucket if use_graph else max(r.rows for r in ranks)
    lora = any(a >= 0 for r in ranks for a in r.adapters)
    return StepAgreement(ranks, mode, rows, use_graph, bucket, lora,
                         all(r.may_run_ahead for r in ranks))


CALLS = ("step agreement", "forward confirmation", "unload_adapter", "warm_up")


class HostExchange:
    """A ``DPEngine``'s host collectives over ``dp.cpu_group``, each ``width`` ints after the
    call's tag (``width``: the step agreement's size for ``max_requests`` requests and
    ``max_adapters`` adapters)."""

    def __init__(self, dp: DPGroup, max_requests: int, max_adapters: int) -> None:
        self.dp, self.max_requests, self.max_adapters = dp, max_requests, max_adapters
        self.width = _HEADER + 2 * max_requests + max_adapters

    def agree(self, mine: RankStep) -> StepAgreement:
        """All-gathers every rank's ``RankStep`` and decides the step. Raises (on every rank)
        when the ranks' loaded adapters (names or weights) or pins differ."""
        rows = self._exchange("step agreement", _pack(mine, self.max_requests,
                                                      self.max_adapters))
        ranks = tuple(_unpack(row) for row in rows)
        if len({r.pool_digest for r in ranks}) != 1:
            raise RuntimeError(f"{self.dp.name}: the ranks' loaded adapters, their weights or "
                               f"pins differ ({[r.pool_digest for r in ranks]}): adapters "
                               "must be loaded from the same weights, pinned and unloaded on "
                               "every rank in the same order")
        return decide(ranks)

    def confirm(self, choice: tuple[int, ...]) -> None:
        """Checks that every rank is about to run the same (rows, bucket, variant): a
        rank-local choice would give the collectives different sizes or paths and hang them."""
        rows = [tuple(r) for r in self._exchange("forward confirmation", choice)]
        if len(set(rows)) != 1:
            raise RuntimeError(f"{self.dp.name}: ranks chose different steps (rows, bucket, "
                               f"lora) {rows}: the step must follow the agreement on every "
                               "rank")

    def ranks_with(self, flag: bool, call: str) -> list[int]:
        """The ranks whose ``flag`` is set, in ``call`` (one of ``CALLS``; every rank calls it,
        and gets the same list)."""
        return [r for r, (f,) in enumerate(self._exchange(call, [int(flag)])) if f]

    def each_rank(self, call: str, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` in ``call`` (one of ``CALLS``; every rank calls it), by
        rank."""
        return self._exchange(call, values)

    def _exchange(self, call: str, values) -> list[list[int]]:
        values = list(values)
        if len(values) > self.width:
            raise ValueError(f"{call}: {len(values)} ints exceed the exchange's {self.width}")
        tag = CALLS.index(call)
        rows = _gather_ints(self.dp, [tag, len(values), *values,
                                      *[0] * (self.width - len(values))], call)
        if any(row[0] != tag for row in rows):
            where = ", ".join(f"rank {r} in {_call_name(row[0])}" for r, row in enumerate(rows))
            raise RuntimeError(f"{self.dp.name}: the ranks are in different calls ({where}): "
                               "every rank must make the same DPEngine calls (step, generate, "
                               "load, pin, unload, warm_up) in the same order")
        return [row[2 : 2 + row[1]] for row in rows]


def _call_name(tag: int) -> str:
    return CALLS[tag] if 0 <= tag < len(CALLS) else f"an unknown call (tag {tag})"


def check_same_setup(dp: DPGroup, setup: dict[str, int | str] | None,
                     refused: Exception | None = None) -> None:
    """Raises on every rank where the ranks' ``setup`` values differ (they size the agreement's
    tensors and decide its collectives: a difference would abort gloo mid-step instead), and
    on the others where a rank ``refused`` its engine (``setup`` None there; that rank raises
    its own error). Through the store, not a host all-gather: a rank that builds a DPEngine
    while its peers step (or unload, or warm up) would meet their all-gather with one of
    another size, and gloo aborted the process; now it raises after the timeout, naming the
    ranks that did not build it, and so do they (their all-gather times out)."""
    mine = ({"refused": f"{type(refused).__name__}: {refused}"} if refused is not None else
            [v if isinstance(v, str) else int(v) for v in setup.values()])
    per_rank = [json.loads(text) for text in
                exchange_through_store(dp, "DPEngine set-up check", json.dumps(mine))]
    refusals = {r: row["refused"] for r, row in enumerate(per_rank) if isinstance(row, dict)}
    if refused is not None:
        return
    if refusals:
        raise ValueError(f"{dp.name}: DPEngine was refused on ranks {list(refusals)} "
                         f"({'; '.join(f'rank {r}: {e}' for r, e in refusals.items())}); "
                         "it is built on no rank: build every rank's DPEngine alike")
    differ = {k: [row[i] for row in per_rank] for i, k in enumerate(setup)
              if len({row[i] for row in per_rank}) > 1}
    if differ:
        raise ValueError(f"{dp.name}: the ranks' engines differ in {differ} (values by rank): "
                         "build every rank's DPEngine with the same model (config, dtype and "
                         "weights: the same checkpoint or seed), SchedulerConfig, KV cache, "
                         "graphs, slots and options")


def _gather_ints(dp: DPGroup, values, call: str) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), by rank, from one host all-gather.
    Where the all-gather itself fails (a peer died, faulted, or waits in another collective
    until the timeout), the ranks no longer pair: the fault is recorded (``mark_fault``), so
    this rank's later calls are refused and its ``shutdown`` leaves at once, and the error
    says so."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = torch.empty(dp.size * mine.numel(), dtype=torch.int64)
    try:
        _all_gather_into(out, mine, dp.cpu_group)
    except Exception as e:
        error = f"{call}: {type(e).__name__}: {e}"
        mark_fault(dp, "a host collective failed", error)
        raise RuntimeError(f"{dp.name}: the {call} all-gather failed ({type(e).__name__}: {e}). "
                           "A peer died, faulted, or is in another collective; DP does not "
                           "recover from faults: restart every rank") from e
    except BaseException as e:  # an interrupt: this rank left the collective half-way
        mark_fault(dp, "a host collective was interrupted",
                   f"{call}: {type(e).__name__}")
        raise
    return out.view(dp.size, -1).tolist()


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def _pack(s: RankStep, max_requests: int, max_adapters: int) -> list[int]:
    n = len(s.lens)
    if n > max_requests or len(s.running_adapters) > max_adapters:
        raise ValueError(f"a rank step holds {n} requests and {len(s.running_adapters)} "
                         f"adapters; the agreement has room for {max_requests} and "
                         f"{max_adapters}")
    head = [_MODES.index(s.mode), n, len(s.running_adapters), s.bucket, s.pool_digest,
            int(s.has_work), max_requests, int(s.may_run_ahead), s.starved]
    body = [*s.adapters, *[-1] * (max_requests - n), *s.lens, *[0] * (max_requests - n),
            *s.running_adapters, *[-1] * (max_adapters - len(s.running_adapters))]
    return head + body


def _unpack(v: list[int]) -> RankStep:
    mode, n, na, bucket, digest, work, cap, ahead, starved = v[:_HEADER]
    body = v[_HEADER:]
    return RankStep(_MODES[mode], tuple(body[:n]), tuple(body[cap : cap + n]), bucket,
                    tuple(body[2 * cap : 2 * cap + na]), digest, bool(work), bool(ahead),
                    starved)
