"""Serving-engine defects found in hunt 7, each pinned by a test that failed before its fix.

Before: the overtake count was kept for the request at the head of the waiting queue when a
step began, so a request that became the oldest waiting one within a step (the one before it
admitted) could be passed in that step uncounted: with ``max_overtake_steps=0`` (strict FCFS)
a small request overtook a large one. The count also outlived the request it was kept for: a
warm-up that failed with a request waiting left its count to the next request that waited,
which then could not be passed at all (the engine said a servable request "can never be
admitted")."""

from __future__ import annotations

import functools

import pytest
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.scheduler import SchedulerConfig


@functools.cache
def _world() -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, slots=2, kv_tokens=40)


def test_no_request_passes_one_that_became_the_oldest_within_the_step():
    """KV: 11 slots free. ``a`` (5) is admitted, ``big`` (10) then waits at the head: with
    ``max_overtake_steps=0`` the small ``c`` (3) behind it must wait too."""
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=8, max_overtake_steps=0))
    eng.add_request(list(range(1, 21)), None, max_new_tokens=10)  # reserves 29 of 40
    eng.step()
    a = eng.add_request([1, 2, 3, 4], None, max_new_tokens=2)
    big = eng.add_request(list(range(1, 11)), None, max_new_tokens=1)
    c = eng.add_request([5, 6, 7], None, max_new_tokens=1)
    eng.step()
    assert a in eng.scheduler.running and big in eng.scheduler.waiting
    assert c in eng.scheduler.waiting, "a later request overtook the oldest waiting one"
    eng.run()
    assert big.metrics.first_token <= c.metrics.first_token
    assert w.runner.kv.free_slots == 40


def test_a_failed_warm_up_leaves_no_overtake_count_behind():
    """Every slot pinned, the warm-up's request on an unpinned adapter can never run: the
    warm-up raises. The next request that waits for a slot may still be passed for
    ``max_overtake_steps`` (1) steps, so the base-model request behind it is served."""
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_overtake_steps=1))
    w.new_adapter(eng, pinned=True)
    w.new_adapter(eng, pinned=True)
    free = w.new_adapter(eng)
    with pytest.raises(RuntimeError, match="can never be admitted"):
        eng.warm_up([free, None])
    eng.add_request([1, 2], free, max_new_tokens=2)
    base = eng.add_request([3], None, max_new_tokens=1)
    eng.step()
    assert base.finish_reason == "length", "the base-model request was not admitted"
    with pytest.raises(RuntimeError, match="can never be admitted"):
        eng.step()
