"""What every rank agrees on before a DP step, in one all-gather of a small int tensor on the
host (gloo) group: each rank's mode, rows, requests (adapter id and rows each), the smallest
graph bucket its batch fits, the adapters its running requests hold, a digest of its slot
table, whether it has work and whether it may launch its next step ahead. Every rank then
derives the same decision from the same data: the mode, the rows per rank (the size of the
gathered buffer), graph or eager, the bucket (the one that fits the largest rank), the graph
variant (with LoRA when any rank's rows have an adapter, so every rank's gathered MLP runs
the same collectives) and whether every rank launches the next step ahead (only where all
may: a rank running ahead alone would enter the next agreement while another returned from
``step()``, and pair it with a different collective)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lora_runtime.dp.group import DPGroup
from lora_runtime.engine.forward_batch import ForwardMode

NO_GRAPH = -1
_MODES = (ForwardMode.IDLE, ForwardMode.DECODE, ForwardMode.EXTEND)
_HEADER = 8


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


def pool_digest(owners: Sequence[str | None], loaded: Sequence[str] = ()) -> int:
    """A digest of the slot table and of the loaded adapters' names (sorted: they number the
    agreement's adapter ids) that is the same in every process (``hash`` is not)."""
    text = "\x1f".join(o or "" for o in owners) + "\x1e" + "\x1f".join(loaded)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def agree(dp: DPGroup, mine: RankStep, max_requests: int, max_adapters: int) -> StepAgreement:
    """All-gathers every rank's ``RankStep`` and decides the step. Raises (on every rank)
    when the ranks' slot tables differ."""
    packed = _pack(mine, max_requests, max_adapters)
    out = torch.empty(dp.size * packed.numel(), dtype=torch.int64)
    _all_gather_into(out, packed, dp.cpu_group)
    ranks = tuple(_unpack(row) for row in out.view(dp.size, -1))
    if len({r.pool_digest for r in ranks}) != 1:
        raise RuntimeError(f"{dp.name}: the ranks' loaded adapters or slot tables differ "
                           f"({[r.pool_digest for r in ranks]}): adapters must be loaded, "
                           "pinned and unloaded on every rank in the same order")
    return decide(ranks)


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


def confirm(dp: DPGroup, choice: tuple[int, ...]) -> None:
    """Checks that every rank is about to run the same (rows, bucket, variant): a rank-local
    choice would give the collectives different sizes or paths and hang them."""
    rows = [tuple(r) for r in _gather_ints(dp, choice)]
    if len(set(rows)) != 1:
        raise RuntimeError(f"{dp.name}: ranks chose different steps (rows, bucket, lora) "
                           f"{rows}: the step must follow the agreement on every rank")


def check_same_setup(dp: DPGroup, setup: dict[str, int]) -> None:
    """Raises on every rank where the ranks' ``setup`` values differ (they size the agreement's
    tensors and decide its collectives: a difference would abort gloo mid-step instead)."""
    per_rank = _gather_ints(dp, list(setup.values()))
    differ = {k: [row[i] for row in per_rank] for i, k in enumerate(setup)
              if len({row[i] for row in per_rank}) > 1}
    if differ:
        raise ValueError(f"{dp.name}: the ranks' engines differ in {differ} (values by rank): "
                         "build every rank's DPEngine with the same SchedulerConfig, slots and "
                         "options")


def ranks_with(dp: DPGroup, flag: bool) -> list[int]:
    """The ranks whose ``flag`` is set (every rank calls it, and gets the same list)."""
    return [r for r, (f,) in enumerate(_gather_ints(dp, [int(flag)])) if f]


def _gather_ints(dp: DPGroup, values) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), by rank, from one host all-gather."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = torch.empty(dp.size * mine.numel(), dtype=torch.int64)
    _all_gather_into(out, mine, dp.cpu_group)
    return out.view(dp.size, -1).tolist()


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def _pack(s: RankStep, max_requests: int, max_adapters: int) -> torch.Tensor:
    n = len(s.lens)
    if n > max_requests or len(s.running_adapters) > max_adapters:
        raise ValueError(f"a rank step holds {n} requests and {len(s.running_adapters)} "
                         f"adapters; the agreement has room for {max_requests} and "
                         f"{max_adapters}")
    head = [_MODES.index(s.mode), n, len(s.running_adapters), s.bucket, s.pool_digest,
            int(s.has_work), max_requests, int(s.may_run_ahead)]
    body = [*s.adapters, *[-1] * (max_requests - n), *s.lens, *[0] * (max_requests - n),
            *s.running_adapters, *[-1] * (max_adapters - len(s.running_adapters))]
    return torch.tensor(head + body, dtype=torch.int64)


def _unpack(row: torch.Tensor) -> RankStep:
    v = row.tolist()
    mode, n, na, bucket, digest, work, cap, ahead = v[:_HEADER]
    body = v[_HEADER:]
    return RankStep(_MODES[mode], tuple(body[:n]), tuple(body[cap : cap + n]), bucket,
                    tuple(body[2 * cap : 2 * cap + na]), digest, bool(work), bool(ahead))
