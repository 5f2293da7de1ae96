"""Engine inputs a client gets slightly wrong (hunt 5), each now refused naming the input, or
served as meant.

Before: ``warm_up(adapters)`` given a generator of adapter names used it up in its own check
and then warmed the base model alone (none of the adapters' kernel variants compiled, so they
compiled mid-serving); an int raised "'int' object is not iterable" and a list among the
names "unhashable type: 'list'". ``WorkloadSpec`` given a ``rate`` or ``zipf_alpha`` that is
not a number (a string from a config file) failed with "'<' not supported between instances
of 'int' and 'str'", ``rate=True`` drew a rate of 1, and a Poisson rate so small that its
mean gap overflows (1e-320) drew every arrival at inf, which ``serve`` then refused; ``serve``
given its workload as a generator checked it (using it up), then asked its length; an
``Engine`` given a clock that is no function was built and failed at its first request."""

from __future__ import annotations

import functools

import pytest
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.engine import Engine
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload, serve


@functools.cache
def _world() -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, kv_tokens=40)


def _served_adapters(eng) -> list:
    """Records the adapter of each request the warm-up adds (on the instance only)."""
    seen = []
    add = eng.add_request

    def recording(prompt, adapter=None, **kwargs):
        seen.append(adapter)
        return add(prompt, adapter, **kwargs)

    eng.add_request = recording
    return seen


@pytest.mark.parametrize("kind", ["generator", "list"])
def test_the_warm_up_serves_adapters_given_in_a_generator(kind):
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    name = w.new_adapter(eng)
    seen = _served_adapters(eng)
    given = (a for a in [name, None]) if kind == "generator" else [name, None]
    report = eng.warm_up(given)
    assert report.steps > 0
    assert set(seen) == {name, None}, f"the warm-up served {set(seen)}"
    assert not eng.has_work and not eng.timeline and w.runner.kv.free_slots == 40


@pytest.mark.parametrize("bad, words", [(5, "takes a list of adapter names"),
                                        ([["x"]], "not an adapter's name"),
                                        ([None, 3], "not an adapter's name")])
def test_the_warm_up_names_adapters_that_are_not_a_list_of_names(bad, words):
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    with pytest.raises(ValueError, match=words):
        eng.warm_up(bad)
    assert not eng.has_work and not eng.timeline and w.runner.kv.free_slots == 40


@pytest.mark.parametrize("kwargs, words", [
    (dict(arrival="poisson", rate="5"), "rate must be a number, got str '5'"),
    (dict(arrival="poisson", rate=True), "rate must be a number, got bool"),
    (dict(zipf_alpha="1"), "zipf_alpha must be a number, got str '1'"),
    (dict(popularity="zipf", num_adapters=2, zipf_alpha=None), "zipf_alpha must be a number"),
    (dict(arrival="poisson", rate=1e-320), "finite rate > 0"),
])
def test_a_workload_rate_or_zipf_alpha_that_is_no_usable_number_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        WorkloadSpec(4, **kwargs)


def test_the_smallest_accepted_poisson_rate_draws_finite_arrivals():
    for rate in (1e-300, 1e-3, 1e300):
        wl = make_workload(WorkloadSpec(3, 2, 1, arrival="poisson", rate=rate), 96)
        assert all(0 < w.arrival < float("inf") for w in wl), rate


def test_serve_takes_its_workload_as_a_generator():
    w = _world()
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    wl = make_workload(WorkloadSpec(3, 4, 2, seed=5), w.config.vocab_size)
    reqs = serve(eng, (r for r in wl))
    assert len(reqs) == 3 and all(len(r.output) == 2 for r in reqs)
    assert [r.prompt for r in reqs] == [list(x.prompt) for x in wl]


@pytest.mark.parametrize("clock", [0.0, "perf_counter"])
def test_an_engine_refuses_a_clock_that_is_no_function(clock):
    w = _world()
    w.engine(SchedulerConfig(max_batch_size=4))
    with pytest.raises(TypeError, match="clock must be a function"):
        Engine(w.runner, SchedulerConfig(max_batch_size=4), w.graphs, clock=clock)
