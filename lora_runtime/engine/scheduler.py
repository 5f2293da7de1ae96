"""Continuous batching: which requests a step prefills or decodes.

Admission moves waiting requests (arrival order) into the running set while three limits
hold: ``max_batch_size`` running requests; the KV cache, where each admitted request reserves
its whole budget (prompt + tokens it may sample), so a running request never meets a full
cache and nothing is ever preempted; and the adapter slots, where the running set's distinct
adapters plus the pinned ones never exceed ``max_loras_per_batch``, so every step's adapters
fit the pool at once. A request that does not fit waits while later ones that fit overtake
it, but only for ``max_overtake_steps`` steps: then admission stops until it fits, so no
request starves.

A step is a prefill while any running request has prompt tokens not yet cached (at most
``max_step_tokens`` of them, a long prompt in chunks), else a decode of every running request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_runtime.checks import is_int
from lora_runtime.engine.forward_batch import ForwardMode
from lora_runtime.engine.requests import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 64
    """Running requests at most (the largest decode batch)."""
    max_step_tokens: int = 2048
    """New tokens one prefill step may process."""
    chunked_prefill: bool = True
    """Split a prompt across steps when it does not fit the step's remaining token budget."""
    max_overtake_steps: int = 32
    """Steps the oldest waiting request may be overtaken by later ones that fit."""

    def __post_init__(self) -> None:
        for name, least in (("max_batch_size", 1), ("max_step_tokens", 1),
                            ("max_overtake_steps", 0)):
            value = getattr(self, name)
            if not is_int(value) or value < least:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= {least}, got "
                                 f"{value!r}")
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"SchedulerConfig.chunked_prefill must be True or False, got "
                             f"{self.chunked_prefill!r}")


@dataclass(frozen=True)
class ScheduledStep:
    mode: ForwardMode
    requests: list[Request]
    chunks: list[int]
    """New tokens per request (1 each in decode)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks)

    @property
    def adapters(self) -> set[str]:
        return {r.adapter for r in self.requests if r.adapter is not None}


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv_capacity: int
    num_slots: int
    pinned: Callable[[], set[str]] = set
    """The adapters pinned now (they hold slots whether or not a request uses them)."""
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    adapter_quota: tuple[set[str], int] | None = None
    """Data-parallel attention: (adapters every rank may use, how many others this rank may
    add this step), so the union of all ranks' adapters fits the slots."""
    draining: list[Request] = field(default_factory=list)
    """Aborted requests whose KV slots a launched step not read yet still writes
    (``Engine.abort``): their slots count as reserved until the engine frees them."""
    admit_adapters: bool = True
    """Data-parallel attention: False while another rank's oldest request has waited past
    ``max_overtake_steps`` for a slot: this rank admits base-model requests only, so the
    slots its adapters hold free up for it (a stream on a resident adapter kept one forever)."""
    _overtaken: int = 0
    """Steps ``_head`` has waited at the head of the queue."""
    _head: Request | None = None
    """The request ``_overtaken`` counts for (a count kept by queue position passed on to
    the next request: a failed warm-up's to the first one served after it)."""
    _oldest_lacks_slot: bool = False

    # -- bookkeeping ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)

    def abort(self, req: Request) -> bool:
        """Takes ``req`` out of the waiting queue or the running set; False where it is in
        neither. The oldest waiting request aborted, the next one starts its own overtake
        count (``_head``)."""
        if req in self.running:
            self.running.remove(req)
            return True
        if req not in self.waiting:
            return False
        self.waiting.remove(req)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reserved(self) -> int:
        """KV slots the running requests hold or may still take, and those aborted requests
        still hold (``draining``)."""
        return (sum(r.kv_budget for r in self.running)
                + sum(len(r.kv_slots) for r in self.draining))

    @property
    def starved_of_slot(self) -> int:
        """Steps the oldest waiting request has waited past ``max_overtake_steps`` with no
        adapter slot for it (0: none such)."""
        if (self.waiting and self.waiting[0] is self._head and self._oldest_lacks_slot
                and self._overtaken > self.config.max_overtake_steps):
            return self._overtaken
        return 0

    def running_adapters(self) -> set[str]:
        return {r.adapter for r in self.running if r.adapter is not None}

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when nothing can run (nothing running and nothing fits)."""
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            return self._prefill(prefilling)
        decoding = [r for r in self.running if not r.done]
        if decoding:
            return ScheduledStep(ForwardMode.DECODE, decoding, [1] * len(decoding))
        return None

    def _admit(self) -> None:
        max_batch = self.config.max_batch_size
        if not self.waiting or len(self.running) >= max_batch:
            return
        free_kv = self.kv_capacity - self.reserved()
        adapters = self.running_adapters() | self.pinned()
        oldest = True  # req is the oldest request still waiting (those before it admitted)
        admitted = []
        for req in self.waiting:  # no copy: a queue of 10,000 cost ~40 us a step to copy
            budget = req.kv_budget
            if budget > free_kv and not oldest:
                # Cannot fit, and only the oldest's wait counts: the KV-bound queue's common
                # case, kept to a comparison (10,000 waiting: 3.4 -> 0.9 ms a scanning step,
                # bench/host ``test_admission_under_a_full_kv_cache``).
                continue
            new_adapters = adapters | ({req.adapter} if req.adapter is not None else set())
            slot = ((req.adapter is None or self.admit_adapters)
                    and self._slots_fit(new_adapters))
            if budget <= free_kv and slot:
                admitted.append(req)
                self.running.append(req)
                free_kv -= budget
                adapters = new_adapters
                if len(self.running) >= max_batch:
                    break
                continue
            if oldest:  # it waits: later ones may pass it, for a while
                oldest = False
                self._count_wait(req, slot)
                if self._overtaken > self.config.max_overtake_steps:
                    break
        for req in admitted:
            self.waiting.remove(req)

    def _count_wait(self, req: Request, slot: bool) -> None:
        """One more step ``req`` waits at the head of the queue (the count starts again for
        a new head: one that became the oldest within a step, the one before it admitted,
        was passed uncounted, even with ``max_overtake_steps=0``)."""
        if req is not self._head:
            self._head, self._overtaken = req, 0
        self._overtaken += 1
        self._oldest_lacks_slot = not slot

    def _slots_fit(self, adapters: set[str]) -> bool:
        if len(adapters) > self.num_slots:
            return False
        if self.adapter_quota is None:
            return True
        known, quota = self.adapter_quota
        return len(adapters - known) <= quota

    def _prefill(self, prefilling: list[Request]) -> ScheduledStep:
        budget = self.config.max_step_tokens
        reqs, chunks = [], []
        for r in prefilling:
            left = len(r.prompt) - len(r.kv_slots)
            take = min(left, budget) if self.config.chunked_prefill else left
            if take == 0 or take > budget:
                continue
            reqs.append(r)
            chunks.append(take)
            budget -= take
            if budget == 0:
                break
        return ScheduledStep(ForwardMode.EXTEND, reqs, chunks)
