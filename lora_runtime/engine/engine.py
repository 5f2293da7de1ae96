"""``Engine``: the serving loop. Requests come in with their own adapter; each ``step`` asks
the scheduler for a prefill or decode batch, runs it (a captured graph when one of the
engine's graph runners fits it, else eagerly), samples greedily and retires finished
requests, freeing their KV cache."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

import torch

from kernels import jit_watch
from lora_runtime.checks import is_int
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.engine.metrics import StepRecord
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.request_checks import check_batch_lists, check_request
from lora_runtime.engine.requests import (
    Request,
    build_decode,
    build_extend,
    check_max_new_tokens,
    id_sequence,
    release,
)
from lora_runtime.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from lora_runtime.engine.warm_up import WarmUpReport, warm_up


class GraphReplayer(Protocol):
    """What the engine needs of a graph runner (``graphs.GraphRunner``)."""

    runner: ModelRunner
    last_kind: str | None
    last_bucket: int | None
    mode: ForwardMode
    buckets: list[int]
    captured: bool

    def bucket_for(self, batch: ForwardBatch) -> int | None: ...
    def can_run(self, batch: ForwardBatch) -> bool: ...
    def variant_for(self, batch: ForwardBatch, step_has_adapters: bool) -> str: ...
    def replay(self, batch: ForwardBatch, bucket: int | None = None,
               variant: str | None = None) -> torch.Tensor: ...


@dataclasses.dataclass
class LaunchedStep:
    """A forward on the device whose tokens the host has not read yet."""

    plan: ScheduledStep
    samples: list[bool]
    """Which requests sample a token (a chunk short of its prompt's end samples nothing),
    fixed at launch: a step launched ahead may cache the rest of a prompt before this
    step's tokens are read."""
    tokens: torch.Tensor
    logits: torch.Tensor | None
    """A copy of the logits, kept only with ``keep_logits``."""
    replayed: GraphReplayer | None
    start: float
    jit: int | None
    ahead: bool = False
    host: torch.Tensor | None = None
    """``tokens`` on the host (pinned on a GPU, valid once ``ready`` has completed)."""
    ready: torch.cuda.Event | None = None
    jit_end: int | None = None
    """The compile count when the next step was launched ahead of this one's read: what
    compiled after that is the next step's (None: count at the record)."""
    graph: tuple[str, int] | None = None
    """The graph variant and bucket replayed (None: eager), read at launch: a step launched
    ahead replays the same runner before this one is recorded."""


class Engine:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig | None = None,
                 graphs: Sequence[GraphReplayer] = (), *, keep_logits: bool = False,
                 clock: Callable[[], float] = time.perf_counter, overlap: bool = False,
                 max_timeline: int | None = 100_000) -> None:
        """``graphs``: captured graph runners, tried in order; a batch none fits runs eagerly.
        ``keep_logits``: keep each request's logits row at every sampled token (tests).
        ``max_timeline``: the timeline keeps at least the last this many steps and at most
        twice as many (None: every step); with ``take_finished`` a long-running server's
        memory stays bounded.
        ``overlap``: launch the next step before reading this one's tokens wherever no token
        but a stop token can change it (``_plan_ahead``), so the host prepares step n+1
        while the device runs step n."""
        if not isinstance(runner, ModelRunner):
            # A model or a KV cache in its place raised "... has no attribute 'lora'".
            raise TypeError(f"Engine: runner must be a ModelRunner, got a "
                            f"{type(runner).__name__}; build one as ModelRunner(model, "
                            "KVCache(model.config, max_tokens, dtype, device), lora_manager or "
                            "None)")
        self.runner, self.lora, self.kv = runner, runner.lora, runner.kv
        if config is not None and not isinstance(config, SchedulerConfig):
            # Engine(runner, graphs) was built, and its first add_request raised "'list' object
            # has no attribute 'chunked_prefill'".
            raise TypeError(f"Engine: config must be a SchedulerConfig (or None for the "
                            f"defaults), got {type(config).__name__} {config!r:.80}; pass "
                            "graph runners as graphs=[...]")
        for what, flag in (("keep_logits", keep_logits), ("overlap", overlap)):
            if not isinstance(flag, bool):  # overlap="no" launched steps ahead
                raise TypeError(f"Engine: {what} must be True or False, got {flag!r:.80}")
        if not callable(clock):  # it failed at the first request, not here
            raise TypeError(f"Engine: clock must be a function returning seconds (e.g. "
                            f"time.perf_counter), got {type(clock).__name__} {clock!r:.80}")
        self.config = config or SchedulerConfig()
        self.graphs = _checked_graphs(graphs, runner)
        self.keep_logits = keep_logits
        self._overlap = overlap
        self._inflight: LaunchedStep | None = None
        self._undelivered: list[tuple[Request, int]] = []
        """Tokens of a step finished while the step launched ahead of it raised: in the
        requests' ``output`` already, returned by the next ``step()``."""
        self._unread: LaunchedStep | None = None
        """A launched step whose tokens could not be read (the wait raised: an interrupt):
        the next ``step()`` reads them before anything else."""
        self._last_end: float | None = None
        self.clock = clock
        slots = self.lora.config.max_loras_per_batch if self.lora is not None else 1
        pinned = (lambda: set(self.lora.pool.pinned)) if self.lora is not None else set
        self.scheduler = Scheduler(self.config, runner.kv.max_tokens, slots, pinned)
        self.timeline: list[StepRecord] = []
        self.max_timeline = max_timeline
        if max_timeline is not None and (not is_int(max_timeline) or max_timeline < 1):
            raise ValueError(f"max_timeline must be a positive integer or None, got "
                             f"{max_timeline!r}")
        self.steps_recorded = 0
        """Steps recorded since the engine was built (a record's ``index``; warm-up steps are
        forgotten)."""
        self.finished: list[Request] = []
        self.logits: dict[int, list[torch.Tensor]] = {}
        self._ids = itertools.count()
        self._hint_eviction()  # from here the manager's own calls see this engine's requests

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], adapter: str | None = None, *,
                    max_new_tokens: int = 16, stop_ids: Sequence[int] = ()) -> Request:
        """Queues a request and returns it (its ``output`` grows as it is served). Raises
        ValueError, changing nothing, on input the engine could never serve."""
        return self._queue(self._checked(prompt_ids, adapter, max_new_tokens, stop_ids))

    def add_requests(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None],
                     max_new_tokens: int = 16) -> list[Request]:
        """``add_request`` for each prompt with its adapter, all or none: every request is
        checked before any is queued."""
        check_batch_lists(prompts, adapters)
        # Shared by every prompt: checked per request, it was blamed on "prompt 0".
        check_max_new_tokens(max_new_tokens, "add_requests: ")
        reqs = []
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
            try:
                reqs.append(self._checked(p, a, max_new_tokens, ()))
            except (ValueError, TypeError) as e:  # which of many prompts was refused
                raise type(e)(f"add_requests: prompt {i}: {e}") from None
        return [self._queue(r) for r in reqs]

    def _checked(self, prompt_ids, adapter, max_new_tokens, stop_ids) -> Request:
        req = Request(id_sequence("prompt_ids", prompt_ids), adapter, max_new_tokens,
                      tuple(id_sequence("stop_ids", stop_ids, ordered=False)))
        check_request(req, self.runner.model.config, self.kv.max_tokens, self.config,
                      self.lora)
        return req

    def _queue(self, req: Request) -> Request:
        req.id = next(self._ids)
        req.metrics.arrival = self.clock()
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> bool:
        """Cancels ``req`` (a request ``add_request`` returned): it finishes at once with
        ``finish_reason == "abort"`` (``metrics.finish`` set, in ``finished`` like any finished
        request), leaves the waiting queue or the running set (its adapter no longer counts
        as running: it holds no slot against a pin or an eviction), and its KV slots are
        freed. Waiting, mid chunked prefill or mid decode alike; the tokens it has keep its
        ``output``, and no later token is appended or returned by ``step()`` (with
        ``overlap``, the step in flight's row for it is discarded, as a stopped request's is,
        and its slots, which that step still writes, are freed once the step is read, counted
        as reserved until then). Returns False, changing nothing, where ``req`` has finished
        already (a stop, its length, an earlier abort): a client that disconnects as its
        request ends is no error. Raises ValueError for a request this engine never queued."""
        if not isinstance(req, Request):
            raise TypeError(f"abort takes the Request add_request returned, got "
                            f"{type(req).__name__} {req!r}")
        if req.metrics.finish is not None:
            return False
        if not self.scheduler.abort(req):
            raise ValueError(f"request {req.id} is not queued or running on "
                             "this engine: abort takes a request this engine's add_request "
                             "returned")
        req.finish_reason = "abort"
        req.metrics.finish = self.clock()
        self.finished.append(req)
        # Tokens already in its output that no step() returned yet: the client is gone.
        self._undelivered = [(r, t) for r, t in self._undelivered if r is not req]
        if any(launched is not None and req in launched.plan.requests
               for launched in (self._unread, self._inflight)):
            self.scheduler.draining.append(req)  # freed by _finish once those steps are read
        else:
            release([req], self.kv)
        return True

    @property
    def has_work(self) -> bool:
        return (self._inflight is not None or self._unread is not None
                or self.scheduler.has_work or bool(self._undelivered))

    # -- adapters while serving -------------------------------------------------------------
    def load_adapter(self, name: str, source, *, pinned: bool = False) -> None:
        """Loads an adapter while requests run. A pinned one takes a slot for good, so it is
        refused when the running requests' adapters would no longer fit beside it."""
        lora = self._manager("load_adapter")
        _check_flag(f"load_adapter({name!r}, pinned={pinned!r})", pinned)  # "no" pinned it
        # Loaded (and so checked) before the slot count: a refused adapter was blamed on the
        # pins ("unpin one"), after which it failed again on its own fault.
        lora.load_adapter(name, source)
        if not pinned:
            return
        try:
            self.pin_adapter(name)
        except BaseException:
            lora.unload_adapter(name)
            raise

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        lora = self._manager("pin_adapter")
        _check_name("pin_adapter", name)
        _check_flag(f"pin_adapter({name!r}, pinned={pinned!r})", pinned)
        if name not in lora.adapters:  # before the slot count, which would name the wrong fix
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(lora.adapters)}); "
                           "load it with Engine.load_adapter first")
        if pinned:
            self._check_pin(name)
        lora.pin_adapter(name, pinned)

    def unload_adapter(self, name: str) -> None:
        """Refused while a waiting or running request uses it."""
        lora = self._manager("unload_adapter")
        _check_name("unload_adapter", name)
        users = [r.id for r in (*self.scheduler.waiting, *self.scheduler.running)
                 if r.adapter == name]
        if users:
            raise ValueError(f"adapter {name!r} is used by requests {users[:8]}; unload it once "
                             "they finish")
        lora.reset_lora_batch()  # the last step is done: its adapters may go
        lora.unload_adapter(name)

    def _manager(self, what: str):
        if self.lora is None:
            raise RuntimeError(f"Engine.{what}: this engine's runner has no LoRA manager (it "
                               "serves the base model only); build the ModelRunner with a "
                               "LoRAManager to serve adapters")
        return self.lora

    def _check_pin(self, name: str) -> None:
        self._hint_eviction()
        need = self._adapters_in_use() | set(self.lora.pool.pinned) | {name}
        if len(need) > self.lora.config.max_loras_per_batch:
            raise ValueError(
                f"pinning {name!r} would leave {len(need)} adapters (running requests' and "
                f"pinned) for {self.lora.config.max_loras_per_batch} slots. Unpin one or wait "
                "for requests to finish")
        self.lora.reset_lora_batch()

    def _adapters_in_use(self) -> set[str]:
        """The adapters a pin must leave room for: the running requests'."""
        return self.scheduler.running_adapters()

    def _hint_eviction(self) -> None:
        """Tells the manager which adapters to evict last (``LoRAManager.evict_last``) and
        which this engine's requests use (``LoRAManager.requested``)."""
        if self.lora is not None:
            self.lora.evict_last = self._evict_last
            self.lora.requested = self._requested

    def _requested(self) -> set[str]:
        return {r.adapter for r in (*self.scheduler.waiting, *self.scheduler.running)
                if r.adapter is not None}

    def _evict_last(self) -> set[str]:
        return self.scheduler.running_adapters()

    def _discard_all(self) -> None:
        """Drops every request, queued or running (their KV slots freed), and the step in
        flight: what a warm-up that failed half-way leaves behind."""
        for launched in (self._unread, self._inflight):
            if launched is not None and launched.ready is not None:
                launched.ready.synchronize()  # its kernels still write the slots freed here
        self._inflight = self._unread = None
        self._undelivered = []
        release(self.scheduler.running + self.scheduler.draining, self.kv)
        self.scheduler.running.clear()
        self.scheduler.draining.clear()
        self.scheduler.waiting.clear()
        if self.lora is not None:
            self.lora.reset_lora_batch()

    # -- the loop ---------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        """Fixed at construction: switched off while a step was in flight, every later step
        raised 'not ready to decode' (and a DP rank switching alone would unpair collectives)."""
        return self._overlap

    @overlap.setter
    def overlap(self, value) -> None:
        raise AttributeError(f"Engine.overlap is fixed at construction (it is {self._overlap}; "
                             f"a step may be in flight): build another Engine with "
                             f"overlap={bool(value)}")

    def step(self) -> list[tuple[Request, int]]:
        """Runs one forward; returns the (request, token) pairs it produced. With ``overlap``
        the forward may already be running (launched by the previous call), and the next
        one may be launched before this one's tokens are read. Tokens a raising ``step()``
        delivered to the requests (the step in flight, finished before the step launched
        ahead of it raised) come first in the next call's return."""
        return self._deliver(self._step())

    def _deliver(self, produced: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        if self._undelivered:
            produced, self._undelivered = self._undelivered + produced, []
        return produced

    def _step(self) -> list[tuple[Request, int]]:
        if self.overlap:
            return self._step_overlapped()
        start = self._start_step()
        plan = self._next_plan()
        if plan is None:
            return []
        with self._undone_on_error(plan):
            logits, replayed = self.forward(self._build(plan))
            # Hazard: the host waits here for the device (an interrupt lands here most): the
            # step's KV slots are given back unless its tokens were read.
            tokens = self._sample(plan, logits)
        produced = self._take(plan, tokens, logits, [not r.prefilling for r in plan.requests])
        self._record(plan, _replayed_as(replayed), start)
        return produced

    def _step_overlapped(self) -> list[tuple[Request, int]]:
        if self._unread is not None:  # the last call's read was interrupted: read it now
            unread, self._unread = self._unread, None
            return self._and_discarded(self._finish(unread))
        cur, self._inflight = self._inflight, None
        if cur is None:
            start = self._start_step()
            plan = self._next_plan()
            if plan is None:
                return []
            with self._undone_on_error(plan):
                cur = self._launch(plan, self._build(plan), start)
        ahead = self._plan_ahead(cur)
        if ahead is not None:
            # Hazard: the next forward reuses the graph's static output; cur's tokens (and
            # kept logits) were taken from it by kernels enqueued before this launch.
            start = self._start_step(ahead_of=cur)

            def launch() -> LaunchedStep:
                with self._undone_on_error(ahead):
                    return self._launch(ahead, self._build(ahead, cur), start, ahead=True)

            self._inflight = self._ahead_of(cur, launch)
        return self._and_discarded(self._finish(cur))

    def _ahead_of(self, cur: LaunchedStep, launch: Callable[[], LaunchedStep | None]
                  ) -> LaunchedStep | None:
        """``launch()`` of the step after ``cur``; where it raises, ``cur`` is finished first
        (its tokens are the requests' ``output`` before the error propagates)."""
        try:
            return launch()
        except BaseException:
            # Hazard: the tokens are in the requests' ``output`` now; a streaming caller reads
            # them from ``step()``'s return, which this raise skips: the next call returns them.
            self._undelivered += self._finish(cur)
            raise

    def _and_discarded(self, produced: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """``produced`` (a step just read) and ``_finish_discarded``'s; where the latter raises
        (an interrupt while the host waits for the discarded step), ``produced`` is returned by
        the next ``step()``: its tokens are in the requests' ``output`` already."""
        try:
            return produced + self._finish_discarded()
        except BaseException:
            self._undelivered += produced
            raise

    def _finish_discarded(self) -> list[tuple[Request, int]]:
        """Finishes at once a step run ahead all of whose requests stopped (a stop token in
        the step before): it serves no one, and left in flight its record would take in the
        time until the caller's next ``step()``."""
        ahead = self._inflight
        if ahead is None or not all(r.done for r in ahead.plan.requests):
            return []
        self._inflight = None
        return self._finish(ahead)

    @contextlib.contextmanager
    def _undone_on_error(self, plan: ScheduledStep):
        """Building and launching ``plan``'s step: where it raises (a forward, a graph replay,
        a KV allocation), the KV slots its build gave each request are freed and the LoRA batch
        reset, so the next step rebuilds it (they would stay as cached tokens whose K/V was
        never written, and a later step would compute over them)."""
        held = [len(r.kv_slots) for r in plan.requests]
        try:
            yield
        except BaseException:
            for r, n in zip(plan.requests, held, strict=True):
                if len(r.kv_slots) > n:
                    kept = r.kv_slots.array[:n].tolist()
                    self.kv.free(r.kv_slots.array[n:].tolist())
                    r.kv_slots = kept
            if self.lora is not None:
                self.lora.reset_lora_batch()
            raise

    def _finish(self, cur: LaunchedStep) -> list[tuple[Request, int]]:
        """Reads ``cur``'s tokens (waiting for its device work alone), retires its requests and
        records the step."""
        try:
            if cur.ready is not None:
                cur.ready.synchronize()  # the one host sync of a step: this step's tokens only
            tokens = cur.host.tolist()
        except BaseException:
            # Hazard: an interrupt while the host waits leaves the step launched (its KV slots
            # taken, a step ahead maybe decoding from its tokens): read it again next call.
            self._unread = cur
            raise
        self._release_drained()
        produced = self._take(cur.plan, tokens, cur.logits, cur.samples)
        self._record(cur.plan, cur.graph, cur.start, cur.jit, cur.ahead, cur.jit_end)
        return produced

    def _release_drained(self) -> None:
        """Frees the KV slots of aborted requests that no launched step still unread writes
        (``abort``; called once a step's tokens are read, its device work done)."""
        if not self.scheduler.draining:
            return
        pending = {r for launched in (self._unread, self._inflight) if launched is not None
                   for r in launched.plan.requests}
        release([r for r in self.scheduler.draining if r not in pending], self.kv)
        self.scheduler.draining = [r for r in self.scheduler.draining if r in pending]

    def _next_plan(self) -> ScheduledStep | None:
        """The scheduler's next step, None when nothing runs; raises when the oldest waiting
        request can never be admitted."""
        plan = self.scheduler.schedule()
        if plan is None and self.scheduler.waiting:
            raise RuntimeError(self._stuck_reason(self.scheduler.waiting[0]))
        return plan

    def _launch(self, plan: ScheduledStep, batch: ForwardBatch, start: float,
                ahead: bool = False) -> LaunchedStep:
        jit = self._jit_at_start
        samples = [not r.prefilling for r in plan.requests]  # ``batch`` cached their tokens
        logits, replayed = self.forward(batch)
        kept = logits.clone() if self.keep_logits else None
        tokens = logits.argmax(-1)
        graph = _replayed_as(replayed)
        if tokens.device.type != "cuda":
            return LaunchedStep(plan, samples, tokens, kept, replayed, start, jit, ahead,
                                host=tokens, graph=graph)
        # Hazard: reading ``tokens`` with ``tolist()`` would queue its copy behind the step
        # launched ahead on the same stream and wait for that one too (no overlap left). The
        # copy to pinned memory is queued now, and the host waits on its event alone.
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(plan, samples, tokens, kept, replayed, start, jit, ahead, host=host,
                            ready=ready, graph=graph)

    def _plan_ahead(self, cur: LaunchedStep) -> ScheduledStep | None:
        return self.scheduler.schedule() if self._may_run_ahead(cur) else None

    def _may_run_ahead(self, cur: LaunchedStep) -> bool:
        """Whether the step after ``cur`` may be scheduled before ``cur``'s tokens are read: no
        token can change it but a stop token, as none of ``cur``'s requests reaches its token
        limit with this step's token (a request that ends by its length leaves the running
        set, which the next schedule depends on). A request that samples a stop token has
        its row of the step run ahead discarded (its KV slots are freed with it), and the
        scheduler, which still counted it running, may admit a waiting request a step later
        than a serial engine would. (A request that stopped before ``cur`` was read has its
        row there discarded: it changes nothing.)"""
        return self.overlap and not ends_by_length(cur.plan.requests, cur.samples)

    def run(self, max_steps: int | None = None) -> list[Request]:
        """Steps until every request is done (or ``max_steps``); returns the finished ones."""
        check_max_steps(max_steps)
        for _ in range(max_steps) if max_steps is not None else itertools.count():
            if not self.has_work:
                break
            self.step()
        return self.finished

    def take_finished(self) -> list[Request]:
        """The finished requests not taken yet, forgotten by the engine (with their kept
        logits): a server calls it after each step so finished requests do not pile up."""
        done, self.finished = self.finished, []
        for r in done:
            self.logits.pop(r.id, None)
        return done

    def generate(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None],
                 max_new_tokens: int = 16) -> list[list[int]]:
        """Greedy generation of a fixed set of prompts: each one's new tokens."""
        reqs = self.add_requests(prompts, adapters, max_new_tokens)
        while not all(r.metrics.finish is not None for r in reqs):
            self.step()
        return [list(r.output) for r in reqs]

    def warm_up(self, adapters: Sequence[str | None] | None = None) -> WarmUpReport:
        """Serves the warm-up workload (``warm_up.py``) eagerly before any request, so the
        kernel variants serving meets compile now, not mid-step; then forgets it (timeline,
        finished requests). ``adapters``: cycled over the requests; default the loaded
        adapters the slots hold (pinned ones first), and the base model. Under DP every rank
        calls it with the same adapters."""
        return warm_up(self, adapters)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, GraphReplayer | None]:
        """Logits of the batch's requests: a graph replay when one fits, else eager."""
        self._hint_eviction()
        for g in self.graphs:
            if g.can_run(batch):
                return g.replay(batch), g
        return self.runner.forward_eager(batch), None

    def _build(self, plan: ScheduledStep, running: LaunchedStep | None = None) -> ForwardBatch:
        """``running``: the step still on the device whose tokens this one decodes from."""
        if plan.mode is not ForwardMode.DECODE:
            return build_extend(plan.requests, self.kv, self.runner.device, plan.chunks)
        if running is None:
            return build_decode(plan.requests, self.kv, self.runner.device)
        row_of = {r: i for i, (r, sampled) in enumerate(zip(running.plan.requests,
                                                            running.samples, strict=True))
                  if sampled}
        rows = [row_of.get(r, -1) for r in plan.requests]
        return build_decode(plan.requests, self.kv, self.runner.device, running.tokens, rows)

    def _sample(self, plan: ScheduledStep, logits: torch.Tensor) -> list[int]:
        """The greedy tokens of ``plan``'s rows, on the host."""
        return logits.argmax(-1).tolist()  # the one host sync of a step

    def _take(self, plan: ScheduledStep, tokens: list[int], logits: torch.Tensor | None,
              samples: list[bool]) -> list[tuple[Request, int]]:
        now = self.clock()
        produced = []
        for i, (req, tok, sampled) in enumerate(zip(plan.requests, tokens, samples,
                                                     strict=True)):
            if req.metrics.finish is not None:  # stopped while this step ran (overlap)
                continue
            if not sampled:  # a chunk that did not reach the prompt's end samples nothing
                continue
            req.output.append(tok)
            if self.keep_logits:
                self.logits.setdefault(req.id, []).append(logits[i].detach().clone())
            m = req.metrics
            m.output_tokens += 1
            if m.first_token is None:
                m.first_token = now
            m.last_token = now
            produced.append((req, tok))
            if req.done:
                m.finish = now
                req.finish_reason = "stop" if tok in req.stop_ids else "length"
                self.scheduler.finish(req)
                release([req], self.kv)
                self.finished.append(req)
        return produced

    def _start_step(self, ahead_of: LaunchedStep | None = None) -> float:
        """The step's start; ``ahead_of``: the step in flight it is launched ahead of, whose
        compiles end here."""
        self._jit_at_start = jit_watch.count()
        if ahead_of is not None:
            ahead_of.jit_end = self._jit_at_start
        return self.clock()

    def _record(self, plan: ScheduledStep, graph: tuple[str, int] | None, start: float,
                jit_at_start: int | None = None, ahead: bool = False,
                jit_at_end: int | None = None) -> None:
        """``graph``: the variant and bucket the step replayed (None: eager)."""
        jit = jit_watch.count() if jit_at_end is None else jit_at_end
        end = self.clock()
        # Overlapped steps: a step's time runs from the later of its launch and the previous
        # step's end, so the steps' seconds add up to the wall time.
        begin = start if self._last_end is None or not self.overlap else max(start,
                                                                             self._last_end)
        self._last_end = end
        at_start = self._jit_at_start if jit_at_start is None else jit_at_start
        if self.max_timeline is not None and len(self.timeline) >= 2 * self.max_timeline:
            del self.timeline[:len(self.timeline) - self.max_timeline + 1]
        self.steps_recorded += 1
        self.timeline.append(StepRecord(
            index=self.steps_recorded - 1, mode=plan.mode.value, batch_size=len(plan.requests),
            tokens=plan.num_tokens, adapters=tuple(sorted(plan.adapters)),
            graph=graph is not None,
            bucket=None if graph is None else graph[1],
            variant=None if graph is None else graph[0],
            start=start, seconds=end - begin,
            compiles=None if jit is None or at_start is None else jit - at_start, ahead=ahead,
        ))

    def _stuck_reason(self, req: Request) -> str:
        pinned = sorted(self.lora.pool.pinned) if self.lora is not None else []
        return (f"request {req.id} (adapter {req.adapter!r}) can never be admitted: nothing "
                f"runs and it still does not fit (pinned adapters {pinned} hold slots of "
                f"{self.scheduler.num_slots}). Unpin an adapter")



def _checked_graphs(graphs, runner: ModelRunner) -> list[GraphReplayer]:
    """``graphs`` as a list (None: none). A graph replays its own runner's model and KV cache:
    with another runner's, graph steps and eager steps would read different caches (silently
    wrong tokens). One graph runner not in a list raised "'GraphRunner' object is not
    iterable", a list holding the ModelRunner "object has no attribute 'runner'"."""
    if graphs is None:
        return []
    if hasattr(graphs, "replay") or isinstance(graphs, (str, bytes)) or not isinstance(
            graphs, Iterable):
        raise TypeError(f"Engine: graphs must be a list of graph runners (graphs.GraphRunner), "
                        f"got {type(graphs).__name__} {graphs!r:.80}; for one: graphs=[g]")
    graphs = list(graphs)
    for i, g in enumerate(graphs):
        if not all(hasattr(g, a) for a in ("runner", "can_run", "replay")):
            raise TypeError(f"Engine: graphs[{i}] is a {type(g).__name__}, not a graph runner: "
                            "pass graphs.GraphRunner.decode(...) / .prefill(...) runners, "
                            "captured")
        if g.runner is not runner:
            raise ValueError(f"graphs[{i}] was built on another ModelRunner than the engine's; "
                             "build each GraphRunner from the runner passed to the engine")
    return graphs


def _check_flag(call: str, flag) -> None:
    """A pin flag must be a bool: "no" or 1 pinned by truthiness, 0.0 or None unpinned."""
    if not isinstance(flag, bool):
        raise ValueError(f"{call}: pinned must be True or False")


def _check_name(call: str, name) -> None:
    """An adapter call's name must be a string (a list raised "unhashable type: 'list'")."""
    if not isinstance(name, str):
        raise ValueError(f"Engine.{call} takes an adapter's name (str), got "
                         f"{type(name).__name__} {name!r:.80}")


def check_max_steps(max_steps) -> None:
    """``run``'s step bound: -1 ran nothing, 2.5 raised Python's "'float' object cannot be
    interpreted as an integer", True ran one step."""
    if max_steps is not None and (not is_int(max_steps) or max_steps < 0):
        raise ValueError(f"run(max_steps={max_steps!r}): max_steps must be an integer >= 0, "
                         "or None to run until every request is done")


def _replayed_as(replayed: GraphReplayer | None) -> tuple[str, int] | None:
    """``(variant, bucket)`` of the replay ``replayed`` just ran (None: eager)."""
    return None if replayed is None else (replayed.last_kind, replayed.last_bucket)


def ends_by_length(requests: Sequence[Request], samples: Sequence[bool],
                   pending: Collection[Request] = ()) -> bool:
    """Whether a request reaches its ``max_new_tokens`` with the token this step samples.
    ``pending``: requests with a token sampled by the step in flight, not read yet."""
    return any(len(r.output) + (r in pending) + 1 >= r.max_new_tokens
               and r.metrics.finish is None
               for r, sampled in zip(requests, samples, strict=True) if sampled)
