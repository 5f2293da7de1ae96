"""Calls a client gets slightly wrong: a prompt in a set, no list of adapters for a batch of
prompts, one adapter name where the warm-up takes a list. Each is refused at once, naming the
input and the fix, with nothing queued or served (before, a set prompt was served in the set's
order, and the others failed deep inside with errors naming neither)."""

from __future__ import annotations

import functools

import pytest
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.scheduler import SchedulerConfig


@functools.cache
def _world() -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, kv_tokens=40)


@pytest.mark.parametrize("prompt", [{5, 1, 3}, frozenset({5, 1, 3}), {5: 0, 1: 0}],
                         ids=["set", "frozenset", "dict"])
def test_a_prompt_in_an_unordered_collection_is_refused(prompt):
    """A set's order is not the prompt's: ``{5, 1, 3}`` was served as [1, 3, 5]."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    with pytest.raises(ValueError, match=r"prompt_ids must be .*ordered.*got a "
                                         rf"{type(prompt).__name__}.*list"):
        eng.add_request(prompt, None, max_new_tokens=2)
    assert not eng.has_work
    ok = eng.add_request([5, 1, 3], None, max_new_tokens=2, stop_ids={7, 9})  # order-free
    eng.run()
    assert ok.stop_ids in ((7, 9), (9, 7)) and len(ok.output) >= 1
    w.check_request(eng, ok)


@pytest.mark.parametrize("adapters, words", [
    (None, r"\[None\] \* len\(prompts\)"),
    ("ad", r"\[name\] \* len\(prompts\)"),
])
def test_a_batch_of_prompts_without_a_list_of_adapters_names_the_fix(adapters, words):
    """``generate(prompts, None)`` (the base model for all) failed with 'object of type
    NoneType has no len()'; a generator of prompts likewise."""
    eng = _world().engine(SchedulerConfig())
    with pytest.raises(ValueError, match=words):
        eng.generate([[1, 2], [3]], adapters, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"a list of prompts.*got generator"):
        eng.add_requests((p for p in [[1, 2], [3]]), [None, None])
    assert not eng.has_work
    assert len(eng.generate([[1, 2], [3]], [None] * 2, max_new_tokens=2)[1]) == 2


def test_a_pin_flag_that_is_not_a_bool_is_refused():
    """``pin_adapter(name, "no")`` pinned (any truthy value did)."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    w.serial = 0
    name = w.new_adapter(eng)
    for flag in ("no", 0, None):
        with pytest.raises(ValueError, match=r"pinned must be True or False"):
            eng.pin_adapter(name, flag)
    assert name not in eng.lora.pool.pinned
    eng.pin_adapter(name)
    assert name in eng.lora.pool.pinned


def test_the_warm_up_refuses_one_adapter_name_for_its_list():
    """``warm_up("ad0")`` was read a letter an adapter: 'adapter 'a' is not loaded'."""
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=2, max_step_tokens=8))
    w.serial = 0
    name = w.new_adapter(eng)
    with pytest.raises(ValueError, match=rf"a list of adapter names.*\['{name}'\]"):
        eng.warm_up(name)
    assert not eng.timeline and not eng.has_work
    assert eng.warm_up([name]).steps > 0


def test_add_requests_names_the_prompt_it_refuses_and_queues_none():
    """One empty prompt among many said "a request needs a non-empty prompt", naming none."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    with pytest.raises(ValueError, match=r"add_requests: prompt 2: a request needs a non-empty"):
        eng.add_requests([[1, 2], [3], [], [4]], [None] * 4, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"add_requests: prompt 1: prompt token ids"):
        eng.add_requests([[1], [10**9]], [None, None], max_new_tokens=2)
    assert not eng.has_work
