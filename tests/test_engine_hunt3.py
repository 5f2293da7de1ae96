"""Engine calls a client gets slightly wrong, each refused at once naming the input and the fix,
with nothing queued, loaded, pinned or served; and a randomized serving property (fixed seeds)
over the workloads earlier tests drew least: prompts at the KV-cache limit and across the
CPU stand-in graphs' context and prefix limits, aborts, and adapters unloaded and loaded again
under the same name (other weights) while requests wait and run.

Before: ``load_adapter(..., pinned="no")`` pinned the adapter (truthiness; ``pin_adapter``
refused such flags); ``add_requests``/``generate`` paired prompts with adapters given in a set
in the set's order (a request silently served with another request's adapter), and read a
mapping of prompts as its keys; ``run(max_steps=-1)`` returned at once having done nothing and
``run(2.5)`` raised "'float' object cannot be interpreted as an integer"; ``Engine(runner,
graphs)`` (the config left out) was built and its first ``add_request`` raised "'list'
object has no attribute 'chunked_prefill'"; ``pin_adapter``/``unload_adapter`` of a list
raised "unhashable type: 'list'"; ``warm_up`` on a model with one position refused its own
decode requests."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld
from runtime_helpers import drawn_adapter, make_runtime

from lora_runtime.engine.engine import Engine
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.model.config import tiny


@functools.cache
def _world(graphs: bool = False, kv_tokens: int = 40) -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, kv_tokens=kv_tokens, graphs=graphs)


def _state(eng: Engine) -> tuple:
    s = eng.scheduler
    return (list(s.waiting), list(s.running), list(s.draining), eng.kv.free_slots,
            sorted(eng.lora.adapters), sorted(eng.lora.pool.pinned), list(eng.lora.pool.owner),
            len(eng.timeline), len(eng.finished))


@pytest.mark.parametrize("flag", ["no", "False", 1, 0.0, None])
def test_a_pinned_load_flag_that_is_not_a_bool_is_refused(flag):
    """``load_adapter(name, ad, pinned="no")`` pinned it: the flag was read by truthiness."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    ad = drawn_adapter(w.config, "p", 1, max_rank=8)
    before = _state(eng)
    with pytest.raises(ValueError, match=r"load_adapter\('p', pinned=.*\): pinned must be "
                                         r"True or False"):
        eng.load_adapter("p", ad, pinned=flag)
    assert _state(eng) == before  # not loaded, not pinned
    eng.load_adapter("p", ad, pinned=False)
    assert "p" in eng.lora.adapters and not eng.lora.pool.pinned


@pytest.mark.parametrize("prompts, adapters, words", [
    ([[1, 2], [3]], {None, "ad0"}, r"^adapters is a set: .*by position.*order"),
    ([[1, 2], [3]], {"ad0": 1, None: 2}, r"^adapters is a dict: .*by position.*order"),
    ({(1, 2), (3,)}, [None, "ad0"], r"^prompts is a set: .*by position.*order"),
    ({(1, 2): "ad0", (3,): None}, [None, "ad0"], r"^prompts is a dict: .*by position.*order"),
])
def test_prompts_or_adapters_in_an_unordered_collection_are_refused(prompts, adapters, words):
    """``add_requests([p0, p1], {None, "ad0"})`` served p0 on whichever adapter the set
    iterated first (with string hashing, a different one from run to run)."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    w.serial = 0
    w.new_adapter(eng)
    before = _state(eng)
    for call in (eng.add_requests, eng.generate):
        with pytest.raises(ValueError, match=words + r".*pass a list"):
            call(prompts, adapters)
        assert _state(eng) == before and not eng.has_work


@pytest.mark.parametrize("steps, words", [(-1, "-1"), (2.5, "2.5"), ("3", "'3'"), (True, "True")])
def test_run_refuses_a_step_count_that_is_not_an_integer_from_0(steps, words):
    """``run(max_steps=-1)`` returned at once, serving nothing; 2.5 raised Python's "'float'
    object cannot be interpreted as an integer"; True ran one step."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    req = eng.add_request([1, 2, 3], None, max_new_tokens=3)
    before = _state(eng)
    with pytest.raises(ValueError, match=rf"run\(max_steps={words}\).*integer >= 0.*None"):
        eng.run(steps)
    assert _state(eng) == before and not req.output
    eng.run(0)
    assert not req.output
    eng.run(1)
    assert len(req.output) == 1
    eng.run()
    assert req.finish_reason == "length" and len(req.output) == 3


def test_a_config_that_is_not_a_scheduler_config_is_refused_at_construction():
    """``Engine(runner, graphs)`` (config left out) was built; its first ``add_request``
    raised "'list' object has no attribute 'chunked_prefill'"."""
    w = _world()
    w.engine(SchedulerConfig())  # resets the shared runner
    for bad in ([], {"max_batch_size": 2}, 8):
        with pytest.raises(TypeError, match=rf"config must be a SchedulerConfig.*got "
                                            rf"{type(bad).__name__}.*graphs="):
            Engine(w.runner, bad)
    assert Engine(w.runner, None).config == SchedulerConfig()


@pytest.mark.parametrize("call", ["pin", "unpin", "unload"])
def test_adapter_calls_name_a_name_that_is_not_a_string(call):
    """``pin_adapter([name])`` raised "unhashable type: 'list'", naming neither the input nor
    the fix."""
    w = _world()
    eng = w.engine(SchedulerConfig())
    w.serial = 0
    name = w.new_adapter(eng)
    before = _state(eng)
    do = {"pin": lambda n: eng.pin_adapter(n), "unpin": lambda n: eng.pin_adapter(n, False),
          "unload": eng.unload_adapter}[call]
    for bad in ([name], {name}, 3):
        with pytest.raises(ValueError, match=r"an adapter's name \(str\).*got"):
            do(bad)
        assert _state(eng) == before


def test_the_warm_up_of_a_model_with_one_position_serves_no_decode():
    """With ``max_position_embeddings=1`` a request holds one token (prompt 1,
    max_new_tokens 1); the warm-up's batch sweep queued decodes (max_new_tokens 2) and
    raised 'the request reaches position 1'."""
    cfg = dataclasses.replace(tiny(1), max_position_embeddings=1)
    r = make_runtime(cfg, dtype=torch.float32, device=DEVICE, slots=1, max_rank=8, kv_tokens=3)
    eng = Engine(r, SchedulerConfig(max_batch_size=2, max_step_tokens=8))
    assert eng.warm_up().steps > 0
    assert not eng.has_work and r.kv.free_slots == 3 and not eng.timeline
    assert len(eng.generate([[5], [7]], [None, None], max_new_tokens=1)[0]) == 1


# -- randomized serving (fixed seeds) ------------------------------------------------------

LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 47, 48, 49, 60, 95, 96, 97]
"""Across the stand-in graphs' prefill buckets (8, 16, 32), decode context (48) and prefix (96)."""


def _serve_randomly(w: EngineWorld, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    mst = rng.randint(1 if chunked else 40, 50)
    eng = w.engine(SchedulerConfig(max_batch_size=rng.randint(1, 9), max_step_tokens=mst,
                                   chunked_prefill=chunked,
                                   max_overtake_steps=rng.randint(0, 4)),
                   overlap=rng.random() < 0.5)
    w.serial = 0
    for _ in range(rng.randint(0, 2)):
        w.new_adapter(eng)
    kv = w.runner.kv.max_tokens
    reqs, served_by = [], {}

    def add():
        adapter = rng.choice([None, *eng.lora.adapters])
        new = rng.choice([1, 1, 2, 3, 5, 8, 20])
        n = min(rng.choice(LENGTHS), min(kv, 110) - new + 1)  # kv_budget == kv at times
        if not chunked:
            n = min(n, mst)
        prompt = [rng.randrange(w.config.vocab_size) for _ in range(n)]
        stop = rng.choice([(), (), tuple(range(0, w.config.vocab_size, 3)),
                           (rng.randrange(w.config.vocab_size),)])
        reqs.append(eng.add_request(prompt, adapter, max_new_tokens=new, stop_ids=stop))
        served_by[reqs[-1].id] = w.adapters.get(adapter)

    for _ in range(rng.randint(1, 5)):
        add()
    steps = 0
    while eng.has_work:
        steps += 1
        assert steps < 600, "the engine never drained"
        act = rng.choice(["step"] * 6 + ["add", "abort", "load", "pin", "unload"])
        if act == "add" and len(reqs) < 12:
            add()
        elif act == "abort" and reqs:
            eng.abort(rng.choice(reqs))
        elif act == "load":  # the same few names again, with other weights
            name = rng.choice(["r0", "r1", "r2"])
            if name not in eng.lora.adapters:
                ad = drawn_adapter(w.config, name, rng.randrange(1000), max_rank=8)
                pin = rng.random() < 0.2
                before = _state(eng)
                try:
                    eng.load_adapter(name, ad, pinned=pin)
                    w.adapters[name] = ad
                except ValueError as e:  # a pin the running requests' adapters leave no room
                    assert pin and "slots" in str(e), e
                    assert _state(eng) == before
        elif act == "pin" and eng.lora.adapters:
            name = rng.choice(sorted(eng.lora.adapters))
            try:
                eng.pin_adapter(name, name not in eng.lora.pool.pinned)
            except ValueError as e:
                assert "slots" in str(e), e
        elif act == "unload" and eng.lora.adapters:
            name = rng.choice(sorted(eng.lora.adapters))
            before = _state(eng)
            try:
                eng.unload_adapter(name)
            except ValueError as e:  # a waiting or running request uses it
                assert "used by requests" in str(e) and _state(eng) == before
        try:
            eng.step()
        except RuntimeError as e:  # pins took every slot a waiting request could use
            assert "can never be admitted" in str(e), e
            for name in list(eng.lora.pool.pinned):
                eng.pin_adapter(name, False)
        s = eng.scheduler
        assert s.reserved() <= kv
        assert len(s.running_adapters() | eng.lora.pool.pinned) <= w.slots
    assert w.runner.kv.free_slots == kv and not eng.scheduler.draining
    compared = 0
    for r in reqs:
        assert r.metrics.finish is not None
        if r.finish_reason != "abort":
            assert r.finish_reason == ("stop" if r.output[-1] in r.stop_ids else "length")
            assert r.finish_reason == "stop" or len(r.output) == r.max_new_tokens
        if r.adapter is not None:
            w.adapters[r.adapter] = served_by[r.id]  # the weights it was served with
        if r.output:
            compared += w.check_request(eng, r)
    return compared, sum(s.graph for s in eng.timeline)


@pytest.mark.parametrize("graphs, kv_tokens, seeds", [(False, 60, range(0, 12)),
                                                      (True, 160, range(12, 18))],
                         ids=["eager-kv60", "graphs-kv160"])
def test_random_serving_matches_each_request_run_alone(graphs, kv_tokens, seeds):
    w = _world(graphs, kv_tokens)
    compared = graph_steps = 0
    for seed in seeds:
        c, g = _serve_randomly(w, seed)
        compared, graph_steps = compared + c, graph_steps + g
    assert compared > 0 and (graph_steps > 0) == graphs


@pytest.mark.parametrize("what", ["overlap", "keep_logits"])
def test_engine_flags_that_are_not_bools_are_refused(what):
    """``overlap="no"`` launched steps ahead (read by truthiness)."""
    w = _world()
    w.engine(SchedulerConfig())  # resets the shared runner
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=rf"{what} must be True or False, got {bad!r}"):
            Engine(w.runner, SchedulerConfig(), **{what: bad})
