"""``DPEngine``: one rank's serving loop under data-parallel attention. Every rank steps in
lockstep: it schedules its own share (a batch, or nothing: an idle forward), all ranks agree
on the step (``agreement``), then each runs the agreed forward (the same graph bucket and
variant on every rank, or eager with the same rows per rank), its MLP serving every rank's
rows. Adapter residency agrees because every rank loads, pins and unloads the same adapters
in the same order and acquires the same union of adapters each step; admission keeps that
union within the slots by sharing the free slots among the ranks, a few per step. The
agreement names an adapter by its index among the loaded names, sorted, and checks that every
rank has loaded the same names (and weights) and pinned the same ones; each rank maps the names
to its own slots."""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from collections.abc import Sequence

import torch

from lora_runtime.dp.agreement import (
    NO_GRAPH,
    HostExchange,
    RankStep,
    StepAgreement,
    check_same_setup,
    pool_digest,
)
from lora_runtime.dp.group import DPGroup, mark_fault
from lora_runtime.dp.shard import check_shard, rebind_mlp
from lora_runtime.engine.engine import (
    Engine,
    GraphReplayer,
    LaunchedStep,
    check_max_steps,
    ends_by_length,
)
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode, GatheredRows
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request
from lora_runtime.engine.scheduler import ScheduledStep, SchedulerConfig
from lora_runtime.engine.warm_up import WarmUpReport, check_warm_up
from lora_runtime.nvtx import phase


class DPEngine(Engine):
    def __init__(self, runner: ModelRunner, dp: DPGroup, config: SchedulerConfig | None = None,
                 graphs=(), *, keep_logits: bool = False, verify: bool = True,
                 overlap: bool = False, max_timeline: int | None = 100_000) -> None:
        """``verify``: confirm with every rank, before each forward, the rows, bucket and
        variant it runs (one more small host all-gather): a divergence raises instead of
        hanging a collective. ``overlap``: as ``Engine``'s; each rank launches its next step
        ahead where its own requests allow."""
        _check_dp(dp)
        _check_group(dp, "DPEngine")  # before its set-up check's collective
        lora = getattr(runner, "lora", None)
        hooks = None if lora is None else (lora.evict_last, lora.requested)
        try:
            self._set_up(runner, dp, config, graphs, keep_logits, verify, overlap, max_timeline)
        except BaseException:
            # Engine.__init__ pointed the manager's hooks at this engine: a refused one must
            # leave them to the engine that serves (its requests unseen, every step raised).
            if hooks is not None:
                lora.evict_last, lora.requested = hooks
            raise

    def _set_up(self, runner, dp, config, graphs, keep_logits, verify, overlap,
                max_timeline) -> None:
        try:
            setup, refused = self._set_up_here(runner, dp, config, graphs, keep_logits, verify,
                                               overlap, max_timeline), None
        except (TypeError, ValueError) as e:
            setup, refused = None, e
        # Hazard: a rank that raised before the set-up check left its peers' check to pair
        # with the next DPEngine it built: they built the refused one, and every later store
        # exchange was one apart. Its refusal goes through the check: every rank raises.
        check_same_setup(dp, setup, refused)
        if refused is not None:
            raise refused
        if runner.dp is not None and runner.dp.closed:  # a model kept from the last group
            rebind_mlp(runner.model, dp)
        self.host = HostExchange(dp, self.config.max_batch_size, self.scheduler.num_slots)
        self.last: StepAgreement | None = None
        self._idle_with_work = 0
        """Agreed steps in a row where no rank ran rows but some rank had requests."""
        self._known: set[str] = set()
        self._steps = 0
        """Step agreements made (the same count on every rank): rotates the free slots' shares."""
        self._agreed: StepAgreement | None = None
        """The agreement of the step being launched (``forward`` runs what it decided)."""
        self._fault: str | None = None
        """The error of a forward that raised on this rank: its collectives and the peers'
        no longer pair, so every later call raises (``_check_in_step``)."""

    def _set_up_here(self, runner, dp, config, graphs, keep_logits, verify, overlap,
                     max_timeline) -> dict[str, int | str]:
        """This rank's part of the set-up: refuses what this rank was given, and returns the
        values every rank's must equal (they size the exchanges or the steps' sequence)."""
        _check_verify(verify)
        super().__init__(runner, config, graphs, keep_logits=keep_logits, overlap=overlap,
                         max_timeline=max_timeline)
        if runner.dp is not None:
            check_shard(runner.dp, dp)
        if runner.dp is None and dp.size > 1:
            raise ValueError(f"the model's MLP is not sharded for the {dp.size} ranks of "
                             f"{dp.name}: call lora_runtime.dp.shard.shard_mlp(model, dp) "
                             "before LoRAManager wraps the model")
        self.dp, self.verify = dp, verify
        c = self.config
        return {"max_batch_size": c.max_batch_size, "max_step_tokens": c.max_step_tokens,
                "chunked_prefill": int(c.chunked_prefill), "kv_tokens": self.kv.max_tokens,
                "slots": self.scheduler.num_slots, "verify": int(verify),
                "lora": int(self.lora is not None), "graphs": _graphs_signature(self.graphs),
                "model config": _crc(repr(runner.model.config)),
                "model dtype": str(next(runner.model.parameters()).dtype),
                "model weights": _replicated_weights_fingerprint(runner.model)}

    # -- adapters: every rank makes the same calls in the same order -------------------------
    def unload_adapter(self, name: str) -> None:
        """Refused on every rank while a request of any rank uses it (one host all-gather)."""
        self._manager("unload_adapter")
        self._check_in_step()
        self._finish_inflight()
        mine = any(r.adapter == name for r in (*self.scheduler.waiting, *self.scheduler.running))
        users = self.host.ranks_with(mine, "unload_adapter")
        if users:
            raise ValueError(f"adapter {name!r} is used by requests of ranks {users}; unload it "
                             "(on every rank) once they finish")
        super().unload_adapter(name)

    def _finish_inflight(self) -> None:
        """Reads the step launched ahead (overlap) before a control call's collective; its
        tokens come first in the next ``step()``. A peer that meets this call in ``step()``
        instead (diverging calls) finishes its own step in flight when that call raises, so
        the ranks leave it alike: kept here, this rank's next ``step()`` ran one agreement
        fewer than the peers' and every later control call met a step agreement again."""
        cur, self._inflight = self._inflight, None
        if cur is not None:
            self._undelivered += self._finish(cur)

    def _adapters_in_use(self) -> set[str]:
        """Every rank's running adapters as of the last agreement (the same on every rank, so
        every rank decides a pin alike)."""
        return self._known | self.scheduler.running_adapters()

    def _evict_last(self) -> set[str]:
        """The agreed union of the ranks' running adapters: the same on every rank (a rank's
        own would make its evictions, and so its slots, differ from its peers')."""
        return self._known

    def _adapter_order(self) -> list[str]:
        return sorted(self.lora.adapters) if self.lora is not None else []

    # -- the loop ---------------------------------------------------------------------------
    def generate(self, prompts, adapters, max_new_tokens: int = 16) -> list[list[int]]:
        """``Engine.generate`` of this rank's prompts (possibly none); every rank calls it, and
        it steps until no rank has work."""
        self._check_in_step()  # before its requests are queued
        try:
            reqs = self.add_requests(prompts, adapters, max_new_tokens)
        except Exception:
            # Refused here (nothing queued), but the peers step through their prompts: step
            # with them, so every rank's next call pairs up, then raise.
            self.run()
            raise
        self.run()
        return [list(r.output) for r in reqs]

    def warm_up(self, adapters: Sequence[str | None] | None = None) -> WarmUpReport:
        """``Engine.warm_up`` on every rank, or on none: a rank that refuses it (requests
        queued, an adapter not loaded) or names other adapters than its peers makes every
        rank raise before any warm-up step."""
        self._check_in_step()
        self._finish_inflight()
        try:
            adapters = check_warm_up(self, adapters)  # read once (a generator's used up)
            error = None
        except (RuntimeError, ValueError) as e:
            error = e
        said = self.host.each_rank("warm_up", [int(error is not None), _crc(repr(adapters))])
        refused = [r for r, (flag, _) in enumerate(said) if flag]
        if error is not None:
            raise error
        if refused:
            raise RuntimeError(f"{self.dp.name}: warm_up was refused on ranks {refused} (see "
                               "their error); it runs on no rank")
        if len({crc for _, crc in said}) > 1:
            # Ladders of other lengths: the rank with the shorter one returned, and its next
            # calls' steps were served inside its peers' warm-up.
            alike: dict[int, list[int]] = {}
            for r, (_, crc) in enumerate(said):
                alike.setdefault(crc, []).append(r)
            raise ValueError(f"{self.dp.name}: warm_up was called with other adapters on the "
                             f"ranks (the ranks that named the same: {list(alike.values())}; "
                             f"this rank's: {adapters}); it runs on no rank: call it with the "
                             "same adapters on every rank")
        return super().warm_up(adapters)

    def run(self, max_steps: int | None = None) -> list[Request]:
        """Steps until no rank has work (every rank must call it, with the same bound)."""
        check_max_steps(max_steps)  # -1 ran one step, 2.5 three
        n = 0
        while max_steps is None or n < max_steps:
            self.step()
            n += 1
            if not self.last.has_work:
                break
        return self.finished

    def _check_in_step(self) -> None:
        """Raises where this rank left the ranks' lockstep: its next host collective would
        pair with a peer's model collective (gloo aborts the process) or another step's."""
        if self._unread is not None:  # reading it on this rank alone would desert the others
            raise RuntimeError(f"{self.dp.name}: an interrupt stopped the read of a step's "
                               "tokens on this rank; DP does not recover from faults (the "
                               "other ranks' collectives went on): restart every rank")
        if self._fault is not None:
            raise RuntimeError(f"{self.dp.name}: a forward raised on this rank mid-step "
                               f"({self._fault}); its collectives and the other ranks' no "
                               "longer pair, and DP does not recover from faults: restart "
                               "every rank")
        _check_group(self.dp, "DPEngine")

    def _step(self) -> list[tuple[Request, int]]:
        self._check_in_step()
        if not self.overlap:
            cur = self._launch_agreed(self._start_step())
            return [] if cur is None else self._finish(cur)
        cur, self._inflight = self._inflight, None
        if cur is None:
            cur = self._launch_agreed(self._start_step())
            if cur is None:
                return []
        # Decided in cur's agreement, alike on every rank: a rank running ahead alone would
        # return from step() one agreement later than the others, and the next collective
        # of another rank (an unload's all-gather) would pair with its agreement.
        if self._agreed.run_ahead:
            start = self._start_step(ahead_of=cur)
            self._inflight = self._ahead_of(cur, lambda: self._launch_agreed(start, cur))
        # Not _finish_discarded: whether a rank's step ahead serves anyone is its own, and a
        # rank finishing it early would make one more agreement in its next step() than others.
        return self._finish(cur)

    def _launch_agreed(self, start: float, running: LaunchedStep | None = None
                       ) -> LaunchedStep | None:
        """Schedules this rank's share, agrees on the step with every rank and launches it
        (None: no rank has rows). ``running``: the step still on the device (overlap). An
        error every rank raises alike (the agreement's checks) leaves them in step, and this
        rank's requests as they were."""
        self._share_free_slots()
        s = self.scheduler
        queued = (deque(s.waiting), list(s.running))
        plan = s.schedule()
        try:
            with self._undone_on_error(plan or ScheduledStep(ForwardMode.IDLE, [], [])):
                return self._agree_and_launch(plan, start, running)
        except BaseException:
            # Admissions of a step no agreement named: kept, their adapters were in no rank's
            # agreed union, the next step's quotas (rotated) let a peer admit as many again,
            # and that union outgrew the slots mid-forward (every rank faulted).
            s.waiting, s.running = queued
            raise

    def _agree_and_launch(self, plan: ScheduledStep | None, start: float,
                          running: LaunchedStep | None) -> LaunchedStep | None:
        batch = None if plan is None else self._build(plan, running)
        ahead = self._may_run_ahead_of(plan, running)
        names = self._adapter_order()
        with phase("collective"):
            ag = self.host.agree(self._rank_step(plan, batch, names, ahead))
        self.last = ag  # ``agree`` checked that every rank loaded ``names``
        self._steps += 1  # agreed on every rank alike (``_share_free_slots``)
        self._known = {names[i] for i in ag.running_adapters}
        if ag.mode is ForwardMode.IDLE:
            self._check_progress(ag)
            return None
        self._idle_with_work = 0
        gathered = GatheredRows(
            ag.mode, ag.rows_per_rank,
            tuple(tuple(names[a] if a >= 0 else None for a in r.adapters) for r in ag.ranks),
            tuple(r.lens for r in ag.ranks))
        if batch is None:
            batch = ForwardBatch.idle(self.lora, self.runner.device, gathered)
        else:
            batch = dataclasses.replace(batch, gathered=gathered)
        self._agreed = ag
        return self._launch(plan or ScheduledStep(ForwardMode.IDLE, [], []), batch, start,
                            ahead=running is not None)

    def _may_run_ahead_of(self, plan: ScheduledStep | None, running: LaunchedStep | None
                          ) -> bool:
        """``Engine._may_run_ahead`` of the step being agreed, judged before ``running``'s
        tokens are read (they count as taken) and after its batch was built (a prompt's last
        chunk is cached by then and samples, as ``_launch`` sees it)."""
        if not self.overlap or plan is None:
            return self.overlap
        pending = set() if running is None else {
            r for r, sampled in zip(running.plan.requests, running.samples, strict=True)
            if sampled}
        return not ends_by_length(plan.requests, [not r.prefilling for r in plan.requests],
                                  pending)

    def _check_progress(self, ag: StepAgreement) -> None:
        """Raises on every rank alike once no rank has run rows for longer than the free
        slots take to reach each rank (``_share_free_slots``) while some rank has requests:
        they wait for an adapter that can never be admitted."""
        self._idle_with_work = self._idle_with_work + 1 if ag.has_work else 0
        if self._idle_with_work <= 2 * self.dp.size:
            return
        idle, self._idle_with_work = self._idle_with_work, 0
        # Counted afresh from here (on every rank alike): after the fix (an unpin) the freed
        # slot may reach the waiting rank only at its turn, and the error came back at once.
        waiting = [r for r, step in enumerate(ag.ranks) if step.has_work]
        reason = (self._stuck_reason(self.scheduler.waiting[0]) if self.scheduler.waiting
                  else "no request waiting; see the error of the ranks that wait")
        raise RuntimeError(f"{self.dp.name}: no rank ran a request for {idle} steps while "
                           f"ranks {waiting} have requests waiting. Rank {self.dp.rank}: "
                           f"{reason}")

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, GraphReplayer | None]:
        """The agreed forward of the step being launched (``_launch_agreed``)."""
        ag = self._agreed
        self._hint_eviction()
        bucket, lora = self._choose(ag)
        if self.verify:
            with phase("collective"):
                self.host.confirm((ag.rows_per_rank, -1 if bucket is None else bucket,
                                   int(lora)))
        try:
            if bucket is None:
                return self.runner.forward_eager(batch), None
            g = self._graphs_for(ag.mode)
            return g.replay(batch, bucket, g.variant_for(batch, lora)), g
        except BaseException as e:
            # Hazard: the peers may be inside the step's collectives; retried, this rank's
            # next host all-gather would pair with one of them.
            self._fault = f"{type(e).__name__}: {e}"
            # The group's other engines refuse too, and shutdown leaves without the peers.
            mark_fault(self.dp, "a DPEngine's forward raised mid-step", self._fault)
            if not isinstance(e, Exception):  # an interrupt stays one
                raise
            # A collective's own error (gloo: "Timed out waiting 3000ms for send") named
            # neither the rank nor what to do.
            raise RuntimeError(f"{self.dp.name}: the step's forward raised mid-step "
                               f"({self._fault}); the peers' collectives no longer pair with "
                               "this rank's. DP does not recover from faults: restart every "
                               "rank") from e

    def _finish(self, cur: LaunchedStep) -> list[tuple[Request, int]]:
        try:
            return super()._finish(cur)
        except BaseException as e:
            if self._unread is not None:  # the peers went on to the next agreement
                mark_fault(self.dp, "an interrupt stopped the read of a step's tokens",
                           type(e).__name__)
            raise

    def _choose(self, ag: StepAgreement) -> tuple[int | None, bool]:
        """The bucket (None: eager) and variant this rank runs: the agreed ones."""
        return ag.bucket if ag.use_graph else None, ag.lora

    def _rank_step(self, plan: ScheduledStep | None, batch: ForwardBatch | None,
                   names: list[str], may_run_ahead: bool) -> RankStep:
        ids = {n: i for i, n in enumerate(names)}
        running = sorted(ids[a] for a in self.scheduler.running_adapters())
        digest = 0 if self.lora is None else pool_digest(
            names, [self.lora.fingerprints[n] for n in names], sorted(self.lora.pool.pinned))
        work, starved = self.scheduler.has_work, self.scheduler.starved_of_slot
        if plan is None:
            return RankStep(ForwardMode.IDLE, (), (), 0, tuple(running), digest, work,
                            may_run_ahead, starved)
        g = self._graphs_for(plan.mode)
        own = g.bucket_for(batch) if g is not None and g.can_run(batch) else None  # captured
        return RankStep(plan.mode, tuple(-1 if r.adapter is None else ids[r.adapter]
                                         for r in plan.requests),
                        tuple(plan.chunks), NO_GRAPH if own is None else own, tuple(running),
                        digest, work, may_run_ahead, starved)

    def _graphs_for(self, mode: ForwardMode) -> GraphReplayer | None:
        return next((g for g in self.graphs if g.mode is mode), None)

    def _share_free_slots(self) -> None:
        """Each step, the slots no rank's running requests hold (nor pinned adapters) are
        shared among the ranks, rotating the remainder, so the union of the adapters that all
        ranks admit stays within the slots. While a rank's oldest request has waited past
        ``max_overtake_steps`` for a slot (the longest-waiting such rank), it takes every free
        slot and the others admit base-model requests only until it is in: a single engine
        stops admitting then, and another rank's stream on a resident adapter kept the slot."""
        if self.lora is None:
            return
        known = self._known | set(self.lora.pool.pinned)
        free = max(0, self.scheduler.num_slots - len(known))
        # Agreed steps, not calls: a step whose agreement raised (on every rank) counted on
        # the ranks that were in step() only (a peer in another call raised without one), and
        # the quotas' rotation drifted apart, two ranks taking the remainder slot at once.
        turn = (self.dp.rank - self._steps) % self.dp.size
        quota = free // self.dp.size + (1 if turn < free % self.dp.size else 0)
        starved = [0] if self.last is None else [r.starved for r in self.last.ranks]
        first = max(range(len(starved)), key=lambda r: (starved[r], -r))
        if starved[first]:
            quota = free if first == self.dp.rank else 0
        self.scheduler.admit_adapters = not starved[first] or first == self.dp.rank
        self.scheduler.adapter_quota = (known, quota)


def _check_dp(dp) -> None:
    """Refuses, naming it, a ``dp`` that is no DPGroup (``DPEngine(runner, config)``, as an
    ``Engine`` is built, raised "'SchedulerConfig' object has no attribute 'check_open'")."""
    if not isinstance(dp, DPGroup):
        raise TypeError(f"DPEngine(runner, dp, config, graphs): dp must be this rank's DPGroup "
                        f"(lora_runtime.dp.group.init_dp), got {type(dp).__name__} {dp!r:.80}")


def _check_verify(verify) -> None:
    """Refuses a ``verify`` that is no bool (the set-up check compared int(verify): "no" raised
    "invalid literal for int()", and 0.5 passed as False there while this rank confirmed every
    step)."""
    if not isinstance(verify, bool):
        raise TypeError(f"DPEngine: verify must be True or False, got {verify!r:.80}")


def _check_group(dp: DPGroup, what: str) -> None:
    """Raises, before any collective, where ``dp`` was shut down or this rank left the ranks'
    lockstep (``group.mark_fault``: a forward of any DPEngine on it raised mid-step, a host
    collective failed): a collective now would pair with one a peer is held in, or with none."""
    dp.check_open(what)
    if dp.fault is not None:
        did, error = dp.fault
        raise RuntimeError(f"{dp.name}: {did} on this rank ({error}); its collectives and the "
                           "other ranks' no longer pair, and DP does not recover from faults: "
                           "restart every rank")


def _graphs_signature(graphs) -> int:
    """The modes and buckets of an engine's graphs and whether each is captured (ranks replay
    the same bucket in a step: each must have it)."""
    return _crc(repr(sorted((g.mode.value, tuple(g.buckets), g.captured) for g in graphs)))


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@torch.no_grad()
def _replicated_weights_fingerprint(model: torch.nn.Module) -> int:
    """A digest of the weights every rank holds whole (all but the sharded MLPs'), the same in
    every process for the same weights: each tensor's bits summed as integers (exact, in any
    order), one host read. Ranks built from other checkpoints or seeds served other tokens
    with no error (each rank's MLP shard came from another model), and another layer count or
    dtype aborted gloo mid-step ("Received data size doesn't match expected size")."""
    sums = [p.detach().reshape(-1).view(_BITS[p.element_size()]).sum(dtype=torch.int64)
            for n, p in model.named_parameters() if ".mlp." not in n]
    if not sums:
        return 0
    return _crc(repr(torch.stack(sums).tolist()))


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
