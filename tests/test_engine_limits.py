"""The engine's limits, one at a time: bad requests are refused while the others are served;
a request that does not fit the KV cache or the adapter slots waits; the oldest waiting
request is overtaken only for a bounded number of steps; a request that can never fit stops
the engine with a reason; workloads are what their spec says."""

from __future__ import annotations

import collections
import dataclasses
from http import HTTPStatus

import numpy
import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.engine import Engine
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload, serve
from lora_runtime.lora.adapters import AdapterError
from lora_runtime.lora.adapters.random_adapter import random_adapter
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def world():
    return EngineWorld("torch", DEVICE, slots=2, kv_tokens=40)


def test_bad_requests_are_refused_and_the_others_served(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4, chunked_prefill=False, max_step_tokens=30))
    name = w.new_adapter(eng)
    good = eng.add_request([1, 2, 3], name, max_new_tokens=3)
    bad = [
        (dict(prompt_ids=[1, 2], adapter="nope"), "unknown adapter"),
        (dict(prompt_ids=[]), "non-empty prompt"),
        (dict(prompt_ids=[1] * 39, max_new_tokens=4), "KV-cache slots"),
        (dict(prompt_ids=[1] * 31, max_new_tokens=1), "chunked prefill is off"),
        (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt_ids=[1], max_new_tokens=4.5), "an integer"),  # reserved 4.5 KV slots
        (dict(prompt_ids=[1], max_new_tokens=True), "an integer"),
        (dict(prompt_ids=[1, 2.5]), "prompt token ids must be integers"),
        (dict(prompt_ids=[1, True]), "prompt token ids must be integers"),
        (dict(prompt_ids=[3, -1]), "outside the vocabulary"),
        (dict(prompt_ids=[1], stop_ids=[0.5]), "stop_ids token ids must be integers"),
        (dict(prompt_ids=[1, w.config.vocab_size]), "outside the vocabulary"),
        (dict(prompt_ids=None), "prompt_ids must be a sequence of token ids"),
        (dict(prompt_ids=7), "prompt_ids must be a sequence of token ids"),
        (dict(prompt_ids="12"), "prompt_ids must be a sequence of token ids"),
        (dict(prompt_ids=[1], stop_ids=5), "stop_ids must be a sequence of token ids"),
        (dict(prompt_ids=[1], adapter=[name]), "an adapter's name"),
        (dict(prompt_ids=[1], adapter=7), "an adapter's name"),
    ]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words):
            eng.add_request(**kwargs)
    assert list(eng.scheduler.waiting) == [good], "a refused request must not be queued"
    other = eng.add_request([4, 5], None, max_new_tokens=2)
    eng.run()
    assert good.metrics.finish is not None and other.metrics.finish is not None
    w.check_request(eng, good)
    w.check_request(eng, other)


def test_request_ids_become_plain_ints_and_are_copied():
    """Integral ids of any type (numpy's, an IntEnum) are stored as Python ints; the prompt is
    the request's own list, not the caller's."""
    prompt = [1, 2, 3]
    req = Request(prompt, None, 2, stop_ids=[numpy.int64(7)])
    prompt.append(4)
    assert req.prompt == [1, 2, 3] and req.stop_ids == (7,)
    mixed = Request([numpy.int32(5), HTTPStatus.OK, 6], None, 2)
    assert mixed.prompt == [5, 200, 6] and {type(t) for t in mixed.prompt} == {int}


def test_generate_refuses_all_its_prompts_or_none(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    name = w.new_adapter(eng)
    for prompts, adapters, words in [
        ([[1, 2, 3], [4, 5]], [name], "2 prompts but 1 adapters"),
        ([[1, 2, 3], []], [name, None], "non-empty prompt"),
        ([[1, 2, 3], [4, 5]], [None, "nope"], "unknown adapter"),
        ([[1, 2, 3], [4, 5], [6]], name[:3], "a list of adapter names"),  # not one a letter
        ([1, 2, 3], [None] * 3, "prompt_ids must be a sequence"),  # one prompt, not a list
    ]:
        with pytest.raises(ValueError, match=words):
            eng.generate(prompts, adapters, max_new_tokens=2)
        assert not eng.scheduler.has_work, "a refused generate() must queue nothing"
    out = eng.generate([[1, 2, 3]], [name], max_new_tokens=2)
    assert len(out[0]) == 2 and [r.id for r in eng.finished] == [0]


@pytest.mark.parametrize("field, value", [
    ("max_batch_size", 2.5), ("max_batch_size", 0), ("max_batch_size", True),
    ("max_step_tokens", 4.5), ("max_step_tokens", "16"), ("max_overtake_steps", -1),
    ("max_overtake_steps", 1.5), ("chunked_prefill", "no"),
])
def test_scheduler_config_refuses_non_integer_limits(field, value):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field}"):
        SchedulerConfig(**{field: value})


def test_a_request_waits_for_kv_capacity(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=8))
    a = eng.add_request(list(range(1, 21)), None, max_new_tokens=10)  # budget 29 of 40
    b = eng.add_request(list(range(1, 16)), None, max_new_tokens=5)   # budget 19: waits
    eng.step()
    assert a in eng.scheduler.running and b in eng.scheduler.waiting
    eng.run()
    first_b = min(s.index for s in eng.timeline if s.mode == "extend" and s.tokens == 15)
    last_a = max(i for i, s in enumerate(eng.timeline) if s.mode == "decode")
    assert a.metrics.finish <= b.metrics.first_token
    assert first_b > 0 and last_a > first_b
    for r in (a, b):
        w.check_request(eng, r)


def test_steps_never_hold_more_adapters_than_slots(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=8))
    names = [w.new_adapter(eng) for _ in range(4)]
    reqs = [eng.add_request([3, 1, 4, 1], names[i % 4], max_new_tokens=3) for i in range(8)]
    eng.run()
    assert all(len(s.adapters) <= w.slots for s in eng.timeline)
    assert {s.adapters for s in eng.timeline} >= {tuple(sorted(names[:2]))}
    for r in reqs:
        w.check_request(eng, r)


def test_pinned_adapters_count_against_the_slots(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=8))
    pinned = w.new_adapter(eng, pinned=True)
    names = [w.new_adapter(eng) for _ in range(2)]
    reqs = [eng.add_request([2, 7], n, max_new_tokens=2) for n in names]
    eng.step()
    assert len(eng.scheduler.running) == 1, "one slot is pinned: one other adapter at a time"
    with pytest.raises(ValueError, match="slots"):
        eng.pin_adapter(names[1] if reqs[0] in eng.scheduler.running else names[0])
    eng.run()
    assert all(len(set(s.adapters) | {pinned}) <= w.slots for s in eng.timeline)


def test_pinning_an_adapter_not_loaded_names_that(world):
    """With every slot held, pinning a name that is not loaded (a typo) said to unpin an
    adapter or wait for requests: doing so, the pin failed again, as not loaded."""
    w = world
    eng = w.engine(SchedulerConfig())
    held = [w.new_adapter(eng, pinned=True) for _ in range(w.slots)]
    for pinned in (True, False):
        with pytest.raises(KeyError, match="'typo' is not loaded .* Engine.load_adapter"):
            eng.pin_adapter("typo", pinned)
    assert eng.lora.pool.pinned == set(held)


@pytest.mark.parametrize("newcomer", ["pin", "prefill"])
def test_eviction_takes_an_idle_adapter_before_a_running_requests(world, newcomer):
    """A request decoding on X sits out a prefill step (only prefilling requests run), and
    a request on W ran since and finished: a new adapter (a pin, a prefill's) then evicted X,
    the least recently used, and X's next decode step wrote it back; it evicts W now."""
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    x, idle, new = (w.new_adapter(eng) for _ in range(3))
    decoding = eng.add_request([3, 4], x, max_new_tokens=6)
    eng.step()
    eng.step()  # prefill, then a decode: X is older than what follows
    eng.add_request([5], idle, max_new_tokens=1)
    eng.step()  # the prefill of W alone, which ends it
    assert eng.lora.pool.slot_of.keys() == {x, idle} and not decoding.done
    if newcomer == "pin":
        eng.pin_adapter(new)
    else:
        eng.add_request([7, 8], new, max_new_tokens=2)
        eng.step()  # the newcomer's prefill
    writes = eng.lora.writer.writes
    assert eng.lora.pool.slot_of.keys() == {x, new}
    eng.run()
    assert decoding.done and eng.lora.writer.writes == writes
    assert decoding.output == [int(t.argmax()) for t in w.alone(decoding)][:len(decoding.output)]


def test_a_pinned_load_of_a_bad_adapter_names_its_fault_not_the_pins(world):
    """With every slot pinned, a pinned load of an adapter above max_rank said to unpin one;
    unpinned, it failed again on its rank. The adapter is checked first; a load refused for
    the pins (its own fault none) leaves it not loaded."""
    w = world
    eng = w.engine(SchedulerConfig())
    held = [w.new_adapter(eng, pinned=True) for _ in range(w.slots)]
    too_big = random_adapter(w.config, "big", 16, seed=1, dtype=torch.float32)
    with pytest.raises(AdapterError, match="max_rank"):
        eng.load_adapter("big", too_big, pinned=True)
    fits = random_adapter(w.config, "fits", 4, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="would leave 3 adapters"):
        eng.load_adapter("fits", fits, pinned=True)
    assert set(eng.lora.adapters) == set(held) and eng.lora.pool.pinned == set(held)


def test_overtaking_is_bounded(world):
    """The oldest request needs a third adapter while two others keep arriving with the two
    running ones: after max_overtake_steps the engine stops admitting them and serves it."""
    w = world
    limit = 3
    eng = w.engine(SchedulerConfig(max_batch_size=8, max_overtake_steps=limit))
    a, b, c = (w.new_adapter(eng) for _ in range(3))
    eng.add_request([1], a, max_new_tokens=6)
    eng.add_request([1], b, max_new_tokens=6)
    eng.step()
    head = eng.add_request([5, 6], c, max_new_tokens=2)
    for i in range(40):
        if head.metrics.finish is not None:
            break
        eng.add_request([1 + i % 5], (a, b)[i % 2], max_new_tokens=3)
        eng.step()
    assert head.metrics.finish is not None, "the oldest request starved"
    assert i <= limit + 12, f"the oldest request waited {i} steps"


def test_a_request_that_can_never_fit_stops_the_engine_with_a_reason(world):
    w = world
    eng = w.engine(SchedulerConfig())
    w.new_adapter(eng, pinned=True)
    w.new_adapter(eng, pinned=True)
    free = w.new_adapter(eng)
    eng.add_request([1, 2], free, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="Unpin"):
        eng.step()


def test_workload_spec():
    vocab = 50
    for pop, n in (("none", 0), ("identical", 1), ("uniform", 4), ("zipf", 8), ("distinct", 40)):
        spec = WorkloadSpec(40, (2, 9), (1, 3), popularity=pop, num_adapters=max(n, 1), seed=1)
        wl = make_workload(spec, vocab)
        assert wl == make_workload(spec, vocab), "a seed gives one workload"
        used = collections.Counter(r.adapter for r in wl)
        assert set(used) <= set(spec.adapter_names) | {None}
        assert all(2 <= len(r.prompt) <= 9 and 1 <= r.max_new_tokens <= 3 for r in wl)
        if pop == "none":
            assert set(used) == {None}
        if pop == "distinct":
            assert len(used) == 40
        if pop == "zipf":
            assert used["adapter-0"] > used["adapter-7"]
    wl = make_workload(WorkloadSpec(200, 4, 2, arrival="poisson", rate=50.0, seed=2), vocab)
    gaps = [b.arrival - a.arrival for a, b in zip(wl, wl[1:], strict=False)]
    assert all(g >= 0 for g in gaps) and 0.01 < sum(gaps) / len(gaps) < 0.04
    with pytest.raises(ValueError, match="rate"):
        WorkloadSpec(4, arrival="poisson")
    bad = [(dict(arrival="poisson", rate=float("nan")), "rate"),  # serve() looped forever
           (dict(arrival="poisson", rate=float("inf")), "rate"),
           (dict(zipf_alpha=float("nan")), "zipf_alpha"), (dict(zipf_alpha=-1.0), "zipf_alpha"),
           (dict(prompt_len=(1, 5, 9)), "prompt_len"), (dict(output_len=(1.9, 2.9)), "output_len"),
           (dict(prompt_len=3.5), "prompt_len"), (dict(num_adapters=2.5), "num_adapters"),
           (dict(seed=None), "seed"),
           (dict(popularity="identical", num_adapters=16), "one adapter"),
           (dict(popularity="distinct", num_adapters=16), "give 4"),
           (dict(popularity="distinct"), "got num_adapters=1 \\(give 4\\)")]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words):
            WorkloadSpec(4, **kwargs)
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadSpec(2.5)
    # alpha only weighs Zipf; however large, no overflow (it did for every popularity)
    for pop in ("uniform", "zipf"):
        wl = make_workload(WorkloadSpec(6, 2, 1, popularity=pop, num_adapters=3,
                                        zipf_alpha=1e6, seed=1), vocab)
        assert pop == "uniform" or {r.adapter for r in wl} == {"adapter-0"}
    assert len(make_workload(WorkloadSpec(2, numpy.int64(5)), vocab)[0].prompt) == 5


def test_serve_adds_requests_at_their_arrival_times(world):
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    now = [0.0]
    eng.clock = lambda: now[0]

    def sleep(dt):
        now[0] += dt

    wl = make_workload(WorkloadSpec(5, (2, 5), 2, arrival="poisson", rate=10.0, seed=3),
                       w.config.vocab_size)
    step = eng.step

    def slow_step():  # every forward takes 50 ms: requests arrive while one runs
        now[0] += 0.05
        return step()

    eng.step = slow_step
    reqs = serve(eng, wl, sleep)
    assert all(r.metrics.finish is not None for r in reqs)
    for r, spec in zip(reqs, wl, strict=True):
        # Its wait for the step it arrived during counts: TTFT runs from its arrival time.
        assert r.metrics.arrival == pytest.approx(spec.arrival)
        assert r.metrics.ttft is not None and r.metrics.ttft >= 0.05 - 1e-9


def test_serve_refuses_a_workload_it_cannot_serve_before_serving_any_of_it(world):
    """A request the engine would refuse (here too long for the KV cache) raised at its
    arrival, after the earlier ones had been queued: they were left in the engine, and the
    error did not say which workload request it was."""
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    wl = make_workload(WorkloadSpec(4, 5, 2, seed=1), w.config.vocab_size)
    too_long = dataclasses.replace(wl[2], prompt=[1] * 45)
    bad = [([*wl[:2], too_long, wl[3]], ValueError, r"workload\[2\].*nothing was served.*KV"),
           ([*wl[:2], dataclasses.replace(wl[2], arrival=float("nan"))], ValueError,
            r"workload\[2\]\.arrival"),
           ([dataclasses.replace(wl[0], arrival=-1.0)], ValueError, r"workload\[0\]\.arrival"),
           (WorkloadSpec(4, 5, 2), TypeError, "make_workload")]
    for workload, error, words in bad:
        with pytest.raises(error, match=words):
            serve(eng, workload)
        assert not eng.has_work and not eng.finished and not eng.timeline
        assert eng.kv.free_slots == eng.kv.max_tokens
    reqs = serve(eng, wl)
    assert [r.id for r in reqs] == [0, 1, 2, 3], "refused workloads took no request id"
    assert all(r.metrics.finish is not None and len(r.output) == 2 for r in reqs)


def test_a_request_past_the_models_positions_is_refused(world, monkeypatch):
    """A request whose last position is past the rotary table would index past it (a device
    assert on a GPU): refused up front, and the warm-up keeps its own requests inside it."""
    w = world
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=30))
    model = eng.runner.model
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config,
                                                             max_position_embeddings=12))
    with pytest.raises(ValueError, match=r"position 12 .* max_position_embeddings = 12"):
        eng.add_request([1] * 10, None, max_new_tokens=4)
    assert not eng.has_work
    report = eng.warm_up([None])  # a 30-token step spread over requests of <= 12 positions
    assert report.steps > 0 and not eng.has_work
    ok = eng.add_request([1] * 10, None, max_new_tokens=3)
    eng.run()
    w.check_request(eng, ok)


def test_an_engine_without_lora_names_the_fix_for_adapter_calls():
    runner = ModelRunner(LlamaForCausalLM.random(tiny(1), torch.float32, DEVICE),
                         KVCache(tiny(1), 32, torch.float32, DEVICE), None)
    eng = Engine(runner)
    for call in (lambda: eng.load_adapter("x", "/nowhere"), lambda: eng.unload_adapter("x"),
                 lambda: eng.pin_adapter("x")):
        with pytest.raises(RuntimeError, match="no LoRA manager"):
            call()
    with pytest.raises(ValueError, match="has no LoRA manager"):
        eng.add_request([1, 2], "x")
    assert len(eng.generate([[1, 2, 3]], [None], 2)[0]) == 2  # the base model still serves


def test_a_long_running_engine_keeps_bounded_history(world):
    """A server steps for ever: the timeline keeps the last ``max_timeline`` to twice as many
    steps, and ``take_finished`` hands finished requests over, forgetting them."""
    runner = ModelRunner(LlamaForCausalLM.random(tiny(1), torch.float32, DEVICE),
                         KVCache(tiny(1), 64, torch.float32, DEVICE), None)
    with pytest.raises(ValueError, match="max_timeline"):
        Engine(runner, max_timeline=0)
    eng = Engine(runner, keep_logits=True, max_timeline=5)
    taken = []
    for i in range(8):
        eng.add_request([1 + i, 2], None, max_new_tokens=3)
        eng.run()
        taken += eng.take_finished()
        assert eng.finished == [] and eng.logits == {}
        assert 5 <= len(eng.timeline) <= 10 or eng.steps_recorded < 5
    assert [len(r.output) for r in taken] == [3] * 8
    assert eng.steps_recorded == 8 * 3
    indices = [s.index for s in eng.timeline]
    assert indices == list(range(eng.steps_recorded - len(indices), eng.steps_recorded))
    before = list(eng.timeline)
    report = eng.warm_up()  # forgets its own steps (more than max_timeline), keeps the rest
    assert report.steps > 10 and eng.steps_recorded == 24 and eng.timeline == before
    eng.generate([[3, 4]], [None], 2)
    assert [s.index for s in eng.timeline][-2:] == [24, 25]


def test_graphs_built_on_another_runner_are_refused(world):
    """A graph replays its own runner's model into its own KV cache: an engine serving with
    another runner's graphs decoded a 50-token prompt eagerly (past the graph's context) over
    a cache its graph-replayed prefill never wrote, silently (every logit off)."""
    from graphs import GraphRunner

    own = GraphRunner.decode(world.runner, [1, 2], 16)
    other = GraphRunner.prefill(world.ref, [8], 2)
    with pytest.raises(ValueError, match=r"graphs\[1\] was built on another ModelRunner"):
        Engine(world.runner, SchedulerConfig(), [own, other])
    assert Engine(world.runner, SchedulerConfig(), [own]).graphs == [own]


@pytest.mark.parametrize("size", [True, 2.5, "64", 0, -1])
def test_a_kv_cache_size_that_is_not_an_integer_above_0_is_refused(size):
    """``True`` built a one-slot cache and 2.5 failed inside torch, naming neither."""
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        KVCache(tiny(1), size, torch.float32, "cpu")


def test_a_kv_cache_size_of_a_numpy_integer_is_taken():
    assert KVCache(tiny(1), numpy.int64(3), torch.float32, "cpu").free_slots == 3


@pytest.mark.parametrize("bad", [[2, 2], [3], [1, 9], [0], [-1]],
                         ids=["given-twice", "already-free", "out-of-range", "scratch", "negative"])
def test_a_double_or_foreign_kv_free_is_refused_and_changes_nothing(bad):
    kv = KVCache(tiny(1), 8, torch.float32, "cpu")
    held = kv.alloc(2)
    assert sorted(held) == [1, 2]
    with pytest.raises(ValueError, match="slot"):
        kv.free(bad)
    assert kv.free_slots == 6
    kv.free(held)  # the legal free still goes through, once
    assert kv.free_slots == 8 and sorted(kv.alloc(8)) == list(range(1, 9))


@pytest.mark.parametrize("limits, kv_tokens, error", [([3, 0], 16, ValueError),
                                                      (None, 6, RuntimeError)],
                         ids=["nothing-to-extend", "cache-full"])
def test_a_refused_extend_build_takes_no_kv_slot(limits, kv_tokens, error):
    """Refused at its second request, the build had already given the first one KV slots
    and marked its prompt cached (a caller outside the engine leaked them)."""
    kv = KVCache(tiny(1), kv_tokens, torch.float32, "cpu")
    first, second = Request([1, 2, 3]), Request([4, 5, 6, 7])
    with pytest.raises(error):
        build_extend([first, second], kv, "cpu", limits)
    assert kv.free_slots == kv_tokens and len(first.kv_slots) == len(second.kv_slots) == 0
    batch = build_extend([first, second], kv, "cpu", [3, 1])
    assert batch.extend_lens == (3, 1) and kv.free_slots == kv_tokens - 4
