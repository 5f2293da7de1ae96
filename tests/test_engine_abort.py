"""``Engine.abort``: a request cancelled while it waits, mid chunked prefill or mid decode
(serial and overlapped, eager and on the CPU stand-in graphs) finishes as aborted, frees its
KV slots and its adapter's hold, gets no token after the abort (an overlapped step in flight
has its row discarded), and leaves the other requests the tokens of a run without it."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.requests import Request
from lora_runtime.engine.scheduler import SchedulerConfig

VICTIM = 2  # the request aborted: it waits behind max_batch_size, then takes 3 chunks


@functools.cache
def _world(graphs: bool) -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, graphs=graphs)


def _add(eng, w: EngineWorld, with_victim: bool) -> list[Request | None]:
    w.serial = 0  # the same adapters (names, weights) in every run
    names = [w.new_adapter(eng) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    specs = [(5, None, 8), (4, names[0], 7), (40, names[1], 10), (6, names[0], 6), (3, None, 5)]
    reqs = []
    for i, (n, adapter, new) in enumerate(specs):
        prompt = torch.randint(0, w.config.vocab_size, (n,), generator=g).tolist()
        reqs.append(eng.add_request(prompt, adapter, max_new_tokens=new)
                    if with_victim or i != VICTIM else None)
    return reqs


@functools.cache
def _reference(graphs: bool) -> tuple[tuple[int, ...], ...]:
    """The outputs of a serial run without the victim."""
    w = _world(graphs)
    eng = w.engine(SchedulerConfig(max_batch_size=2, max_step_tokens=16))
    reqs = _add(eng, w, with_victim=False)
    eng.run()
    return tuple(() if r is None else tuple(r.output) for r in reqs)


def _due(victim: Request, when: str, calls: int, eng) -> bool:
    if when == "waiting":
        return calls >= 1 and victim in eng.scheduler.waiting
    if when == "prefill":  # some chunk cached (serial) or launched (overlap), none sampled
        return len(victim.kv_slots) > 0 and not victim.output
    # decode; with overlap, while the step in flight decodes it (a token to discard)
    launched = eng._inflight.plan.requests if eng._inflight is not None else ()
    return len(victim.output) >= 2 and (not eng.overlap or victim in launched)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("when", ["waiting", "prefill", "decode"])
def test_abort_frees_the_request_and_leaves_the_others_tokens(when, overlap, graphs):
    w = _world(graphs)
    want = _reference(graphs)
    eng = w.engine(SchedulerConfig(max_batch_size=2, max_step_tokens=16), overlap=overlap)
    reqs = _add(eng, w, with_victim=True)
    victim = reqs[VICTIM]
    streamed: dict[int, list[int]] = {}
    calls, kept, in_flight, was_in_flight = 0, None, False, False
    while eng.has_work:
        if kept is None and _due(victim, when, calls, eng):
            kv = w.runner.kv.free_slots
            in_flight = eng._inflight is not None and victim in eng._inflight.plan.requests
            held, was_in_flight = len(victim.kv_slots), in_flight
            assert eng.abort(victim) is True
            kept = list(victim.output)
            assert victim.finish_reason == "abort" and victim.done
            assert victim.metrics.finish is not None and victim in eng.finished
            assert victim not in eng.scheduler.running and victim not in eng.scheduler.waiting
            if in_flight:  # the step in flight still writes its slots: freed once it is read
                assert eng.scheduler.draining == [victim] and w.runner.kv.free_slots == kv
            else:
                assert w.runner.kv.free_slots == kv + held and not victim.kv_slots
            assert eng.abort(victim) is False, "a second abort changes nothing"
        calls += 1
        assert calls < 200, "the engine never drained"
        for req, token in eng.step():
            assert req is not victim or kept is None, "a token of the victim after its abort"
            streamed.setdefault(req.id, []).append(token)
        if in_flight:
            in_flight = False
            assert not eng.scheduler.draining and not victim.kv_slots
    assert kept is not None, f"the victim was never {when}"
    if when == "waiting":
        assert not kept
    if when == "prefill":
        assert not kept
    if when == "decode":
        assert 2 <= len(kept) < victim.max_new_tokens - 1
    if overlap and when != "waiting":  # the step in flight had a row of it (discarded)
        assert was_in_flight and any(s.ahead for s in eng.timeline)
    assert victim.output == kept and streamed.get(victim.id, []) == kept
    for r, out in zip(reqs, want, strict=True):
        if r is victim:
            continue
        assert tuple(r.output) == out, f"request {r.id}: {r.output} != {out}"
        assert streamed[r.id] == r.output and r.finish_reason == "length"
    assert {r.id for r in eng.finished} == {r.id for r in reqs}
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens
    assert not eng.has_work and not eng.scheduler.draining


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_an_aborted_requests_adapter_no_longer_holds_a_slot(overlap):
    """Two adapters run in two slots: a third cannot be pinned until the request on one of
    them is aborted; its adapter is then no longer kept from eviction either."""
    w = _world(False)
    eng = w.engine(SchedulerConfig(max_batch_size=4), overlap=overlap)
    a, b, c = (w.new_adapter(eng) for _ in range(3))
    victim = eng.add_request([3, 4, 5], a, max_new_tokens=8)
    other = eng.add_request([6, 7], b, max_new_tokens=8)
    eng.step()
    eng.step()
    with pytest.raises(ValueError, match="Unpin one or wait"):
        eng.pin_adapter(c)
    assert eng.abort(victim)
    assert eng.scheduler.running_adapters() == {b} and eng._evict_last() == {b}
    eng.pin_adapter(c)
    eng.run()
    assert other.finish_reason == "length" and len(other.output) == 8
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_aborted_slots_count_as_reserved_until_the_step_in_flight_is_read():
    """Overlap: the victim's slots, still written by the step in flight, are not free when the
    next step is planned; a request admitted on them would meet a full cache (the schedule
    counted them free). It waits one step instead and is served as it is alone."""
    w = EngineWorld("torch", DEVICE, layers=1, kv_tokens=40)
    eng = w.engine(SchedulerConfig(max_batch_size=4), overlap=True)
    victim = eng.add_request(list(range(1, 21)), None, max_new_tokens=13)  # 32 slots
    other = eng.add_request([5, 6, 7], None, max_new_tokens=6)  # 8 slots
    while len(victim.output) < 2:
        eng.step()
    assert victim in eng._inflight.plan.requests
    assert eng.abort(victim)
    late = eng.add_request(list(range(30, 60)), None, max_new_tokens=2)  # 31 slots
    eng.run()
    alone = w.engine(SchedulerConfig(max_batch_size=4))
    want = alone.generate([late.prompt, other.prompt], [None, None], max_new_tokens=6)
    assert late.output == want[0][:2] and other.output == want[1]
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_abort_of_a_finished_or_unknown_request():
    """A finished request (its length, a stop id, an earlier abort): False, nothing changes.
    A request this engine never queued: ValueError."""
    w = _world(False)
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    done = eng.add_request([1, 2], None, max_new_tokens=2)
    eng.run()
    assert done.finish_reason == "length"
    finished = list(eng.finished)
    assert eng.abort(done) is False
    assert done.finish_reason == "length" and eng.finished == finished
    stop = eng.add_request([1, 2], None, max_new_tokens=4, stop_ids=[done.output[0]])
    eng.run()
    assert stop.finish_reason == "stop" and eng.abort(stop) is False
    with pytest.raises(ValueError, match="not queued or running on this engine"):
        eng.abort(Request([1, 2, 3]))
    with pytest.raises(TypeError, match="the Request add_request returned"):
        eng.abort(done.id)
    other = w.engine(SchedulerConfig()).add_request([1, 2], None)
    with pytest.raises(ValueError, match="add_request"):
        eng.abort(other)


@pytest.mark.parametrize("fault", ["read", "launch"])
def test_abort_after_a_fault_left_a_step_unread_or_tokens_undelivered(monkeypatch, fault):
    """Overlap, a fault mid-``step()`` then an abort: ``read``, the host's wait for a step with
    the victim's row is interrupted (the step stays unread, its slots written); ``launch``,
    the step launched ahead raises after the step in flight was read (its tokens wait in
    the requests' output for the next ``step()``). The victim gets no token from any later
    ``step()``, its slots are freed once no unread step writes them, and the other request
    is served as without the fault."""
    from lora_runtime.engine import engine as engine_module

    w = _world(False)
    eng = w.engine(SchedulerConfig(max_batch_size=2), overlap=True)
    want = eng.generate([[9, 8, 7]], [None], max_new_tokens=8)[0]
    victim = eng.add_request([1, 2, 3, 4], None, max_new_tokens=8)
    other = eng.add_request([9, 8, 7], None, max_new_tokens=8)
    raised = []

    class Event:  # stands in for a step's CUDA event (CPU steps have none)
        def __init__(self, step):
            self.step = step

        def synchronize(self) -> None:
            if (fault == "read" and not raised and victim in self.step.plan.requests
                    and len(victim.output) == 2):
                raised.append(self.step)
                raise KeyboardInterrupt("Ctrl-C while the host waits for the tokens")

    real_launch = engine_module.Engine._launch

    def launch(self, plan, batch, start, ahead=False):
        if fault == "launch" and ahead and not raised and len(victim.output) == 2:
            raised.append(plan)
            raise KeyboardInterrupt("Ctrl-C launching the step ahead")
        step = real_launch(self, plan, batch, start, ahead)
        step.ready = Event(step)
        return step

    monkeypatch.setattr(engine_module.Engine, "_launch", launch)
    streamed: dict[int, list[int]] = {}
    kept = None
    for _ in range(100):
        if not eng.has_work:
            break
        try:
            for req, token in eng.step():
                assert req is not victim or kept is None, "a token of the victim after abort"
                streamed.setdefault(req.id, []).append(token)
        except KeyboardInterrupt:
            kept = list(victim.output)
            if fault == "read":
                assert victim in eng._unread.plan.requests
            else:
                assert any(r is victim for r, _ in eng._undelivered)
            assert eng.abort(victim)
            assert (eng.scheduler.draining == [victim]) == (fault == "read")
    assert raised and kept is not None
    assert victim.output == kept and victim.finish_reason == "abort"
    assert streamed[victim.id] == kept[:len(streamed[victim.id])]
    assert other.output == want and streamed[other.id] == want
    assert other.finish_reason == "length"
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens and not eng.scheduler.draining
    assert not eng.has_work


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_an_aborted_requests_tpot_ends_at_its_last_token(overlap):
    """A fake clock, one second a ``step()``: a request with tokens read at 1, 2, 3 s and
    aborted at 100 s has TPOT 1 s (it was (100 - 1) / 2 = 49.5 s, the idle time before the
    abort counted as decoding); a request that finishes by its length keeps (finish - first)
    / (n - 1), and one aborted before its first token has neither TTFT nor TPOT."""
    w = _world(False)
    eng = w.engine(SchedulerConfig(max_batch_size=1), overlap=overlap)
    now = [0.0]
    eng.clock = lambda: now[0]
    victim = eng.add_request([1, 2, 3], None, max_new_tokens=8)
    waiting = eng.add_request([4, 5], None, max_new_tokens=8)
    for t in (1.0, 2.0, 3.0):
        now[0] = t
        eng.step()
    assert len(victim.output) == 3 and victim.metrics.tpot is None  # running
    now[0] = 100.0
    assert eng.abort(victim) and eng.abort(waiting)
    m = victim.metrics
    assert (m.arrival, m.first_token, m.finish, m.output_tokens) == (0.0, 1.0, 100.0, 3)
    assert m.ttft == 1.0 and m.tpot == 1.0
    assert waiting.metrics.ttft is None and waiting.metrics.tpot is None
    eng.run()
    done = eng.add_request([6, 7], None, max_new_tokens=3)
    for t in (101.0, 103.0, 107.0):
        now[0] = t
        eng.step()
    assert done.finish_reason == "length" and (done.metrics.ttft, done.metrics.tpot) == (1.0, 3.0)
