"""Eighth hunt, the serving engine over graph replays (CPU stand-in): random serving where
faults land inside a replay (after its LoRA metadata was refreshed: in the model-input
refresh, in the replayed graph itself) and inside slot writes (after the slot was zeroed),
beside refused requests, aborts, and adapters reloaded under the same names with other
weights, over buckets small enough that steps move between graphs and eager forwards (batch
size, context and prefix limits). Every logits row equals the request run alone, every token
reaches the stream once, and the cache ends free. No defect was found by it (hunt 8); it
keeps the paths covered."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld
from runtime_helpers import drawn_adapter

import graphs.replayable as replayable
import graphs.static_batch as static_batch
from graphs import GraphRunner
from lora_runtime.engine.scheduler import SchedulerConfig

POINTS = ("refresh", "graph", "eager", "alloc", "slot")


class Boom(Exception):
    pass


class Faults:
    """Raises ``Boom`` at the next call of the armed point."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.raised = 0

    def trip(self, point: str) -> None:
        if self.armed == point:
            self.armed = None
            self.raised += 1
            raise Boom(point)

    def wrap(self, point: str, fn):
        def wrapper(*args, **kwargs):
            self.trip(point)
            return fn(*args, **kwargs)

        return wrapper


@functools.cache
def _world() -> EngineWorld:
    w = EngineWorld("torch", DEVICE, layers=1, slots=2, kv_tokens=60)
    w.graphs = [GraphRunner.decode(w.runner, [1, 3], 16).capture(),
                GraphRunner.prefill(w.runner, [4, 16], 2, 8).capture()]
    return w


def _install(monkeypatch, w: EngineWorld, faults: Faults) -> None:
    for cls in (static_batch.DecodeBuffers, static_batch.PrefillBuffers):
        monkeypatch.setattr(cls, "write", faults.wrap("refresh", cls.write))
    monkeypatch.setattr(replayable.TracedGraph, "replay",
                        faults.wrap("graph", replayable.TracedGraph.replay))
    monkeypatch.setattr(w.runner, "forward_eager", faults.wrap("eager", w.runner.forward_eager))
    monkeypatch.setattr(w.runner.kv, "alloc", faults.wrap("alloc", w.runner.kv.alloc))
    writer = w.lora.writer
    real_write = writer.write

    def half_written(image, slot):  # the slot zeroed, then the copy fails
        if faults.armed == "slot":
            torch._foreach_zero_(writer._views_of(slot)[0])
            faults.trip("slot")
        return real_write(image, slot)

    monkeypatch.setattr(writer, "write", half_written)


def _serve(w: EngineWorld, faults: Faults, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    eng = w.engine(SchedulerConfig(max_batch_size=rng.randint(1, 5),
                                   max_step_tokens=rng.randint(3, 20)),
                   overlap=rng.random() < 0.5)
    vocab, kv = w.config.vocab_size, w.runner.kv.max_tokens
    reqs, served_by, streamed = [], {}, {}

    def load(name: str) -> None:
        ad = drawn_adapter(w.config, name, rng.randrange(10_000), max_rank=8)
        try:
            eng.load_adapter(name, ad, pinned=rng.random() < 0.2)
            w.adapters[name] = ad
        except (ValueError, Boom):  # no room to pin, or the pin's slot write faulted
            pass

    def add() -> None:
        adapter = rng.choice([None, *eng.lora.adapters])
        new = rng.choice([1, 2, 4, 7])
        prompt = [rng.randrange(vocab) for _ in range(min(rng.choice([1, 3, 9, 15, 30]),
                                                          kv - new + 1))]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.add_request(prompt + [vocab], adapter)  # refused, nothing queued
        reqs.append(eng.add_request(prompt, adapter, max_new_tokens=new,
                                    stop_ids=rng.choice([(), (rng.randrange(vocab),)])))
        served_by[reqs[-1].id] = w.adapters.get(adapter)

    for name in ("r0", "r1"):
        load(name)
    for _ in range(rng.randint(2, 5)):
        add()
    for _ in range(400):
        if not eng.has_work:
            break
        act = rng.choice(["step"] * 5 + ["add", "abort", "reload", "fault"])
        if act == "add" and len(reqs) < 12:
            add()
        elif act == "abort":
            eng.abort(rng.choice(reqs))
        elif act == "reload":  # the same name again, with other weights, once unused
            name = rng.choice(["r0", "r1", "r2"])
            try:
                if name in eng.lora.adapters:
                    eng.unload_adapter(name)
                load(name)
            except ValueError as e:
                assert "used by requests" in str(e), e
        elif act == "fault":
            faults.armed = rng.choice(POINTS)
        try:
            for req, token in eng.step():
                streamed.setdefault(req.id, []).append(token)
        except Boom:
            assert w.lora.backend.batch_info is None
        except RuntimeError as e:  # pins took the slot a waiting request needs
            assert "can never be admitted" in str(e), e
            for name in list(eng.lora.pool.pinned):
                eng.pin_adapter(name, False)
    assert not eng.has_work and w.runner.kv.free_slots == kv
    faults.armed = None
    compared = 0
    for r in reqs:
        got = streamed.get(r.id, [])
        assert got == (r.output[: len(got)] if r.finish_reason == "abort" else r.output)
        if r.output:
            w.adapters[r.adapter] = served_by[r.id]  # the weights it was served with
            compared += w.check_request(eng, r)
    return compared, sum(s.graph for s in eng.timeline)


def test_faults_inside_replays_and_slot_writes_leave_every_request_served_right(monkeypatch):
    w, faults = _world(), Faults()
    _install(monkeypatch, w, faults)
    compared = graph_steps = 0
    for seed in range(4):
        c, g = _serve(w, faults, seed)
        compared, graph_steps = compared + c, graph_steps + g
    assert faults.raised >= 4 and compared > 20 and graph_steps > 20
