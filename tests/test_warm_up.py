"""The engine's warm-up: its phases fit any engine's limits; serving after it is exactly what
serving without it is (nothing of it stays in the cache, the timeline or the adapters' batch
state); on a GPU no step compiles a kernel after it."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU
from engine_world import EngineWorld
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import drawn_adapter

from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.warm_up import ladder, warm_up_phases


@settings(max_examples=200)
@given(step=st.integers(1, 5000), batch=st.integers(1, 300), kv=st.integers(2, 30000),
       adapters=st.lists(st.sampled_from(["a", "b", "c", None]), max_size=5),
       positions=st.one_of(st.none(), st.integers(2, 4096)))
def test_phases_fit_the_engine_and_span_its_limits(step, batch, kv, adapters, positions):
    phases = warm_up_phases(step, batch, kv, adapters, positions)
    cap = positions or kv
    tokens, sizes = [], []
    for phase in phases:
        assert 1 <= len(phase) <= batch, "a phase's requests run together"
        assert all(1 <= r.prompt_len <= step for r in phase), "a prompt fits one step"
        assert all(r.prompt_len + r.max_new_tokens - 1 <= cap for r in phase), \
            "no request reaches past the model's positions"
        assert sum(r.prompt_len + r.max_new_tokens - 1 for r in phase) <= kv, "fits the cache"
        assert {r.adapter for r in phase} <= set(adapters or [None])
        if all(r.max_new_tokens == 1 for r in phase):
            tokens.append(sum(r.prompt_len for r in phase))
        else:
            sizes.append(len(phase))
    assert tokens == ladder(min(step, kv, batch * cap)), \
        "the token sweep: 1, 2, 4, ... up to the budget"
    assert sizes == ladder(min(batch, kv // 2)), "the batch sweep: 1, 2, 4, ... up to the limit"


def test_ladder():
    assert ladder(1) == [1] and ladder(2) == [1, 2] and ladder(5) == [1, 2, 4, 5]
    assert ladder(8) == [1, 2, 4, 8] and ladder(0) == []


@pytest.fixture(scope="module")
def world():
    return EngineWorld("torch", DEVICE, graphs=True)


def _serve(w: EngineWorld, warm: bool, names: list[str]):
    eng = w.engine(SchedulerConfig(max_batch_size=6, max_step_tokens=40))
    for name in names:
        eng.load_adapter(name, w.adapters[name])
    report = eng.warm_up() if warm else None
    assert not eng.timeline and not eng.finished and not eng.logits
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(7):
        plen = int(torch.randint(1, 30, (1,), generator=g))
        prompt = torch.randint(0, w.config.vocab_size, (plen,), generator=g).tolist()
        reqs.append(eng.add_request(prompt, [None, *names][i % 3], max_new_tokens=3 + i % 4))
    eng.run()
    return eng, reqs, report


def test_serving_after_the_warm_up_is_unchanged(world):
    names = [world.new_adapter(world.engine(SchedulerConfig())) for _ in range(2)]
    cold, cold_reqs, _ = _serve(world, False, names)
    cold_out = [list(r.output) for r in cold_reqs]
    cold_logits = [torch.stack(cold.logits[r.id]) for r in cold_reqs]
    warm, warm_reqs, report = _serve(world, True, names)
    assert report.steps > 0 and report.seconds > 0
    assert report.compiles is None if not ON_GPU else report.compiles >= 0
    assert [list(r.output) for r in warm_reqs] == cold_out
    for r, want in zip(warm_reqs, cold_logits, strict=True):
        assert torch.equal(torch.stack(warm.logits[r.id]), want)
    for r in warm_reqs:
        world.check_request(warm, r)


def test_warm_up_refuses_a_busy_engine_or_an_unknown_adapter(world):
    eng = world.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        eng.warm_up(["nope"])
    assert not eng.timeline and not eng.has_work
    req = eng.add_request([1, 2, 3], None, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="before serving"):
        eng.warm_up()
    assert eng.scheduler.waiting[0] is req and not eng.timeline
    eng.run()
    assert len(req.output) == 2


def test_warm_up_with_every_slot_pinned(world):
    """Its default adapters start with the pinned ones: an unpinned one could never run."""
    eng = world.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    # Sorts before every "adN": by name alone the warm-up would pick it, and it never runs.
    eng.load_adapter("a0-unpinned", drawn_adapter(world.config, "a0-unpinned", 99, max_rank=8))
    for name in [world.new_adapter(eng, pinned=True) for _ in range(world.slots)]:
        assert name in eng.lora.pool.pinned
    report = eng.warm_up()
    assert report.steps > 0 and not eng.has_work and not eng.timeline


def test_a_failed_warm_up_leaves_nothing_behind(world):
    """Its phases served before the failure, and the request that failed, are forgotten: the
    user's next request is the only one served."""
    eng = world.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16))
    for _ in range(world.slots):
        world.new_adapter(eng, pinned=True)
    stranger = world.new_adapter(eng)  # no slot left for it: can never be admitted
    free = world.runner.kv.free_slots
    with pytest.raises(RuntimeError, match="can never be admitted"):
        eng.warm_up([None, stranger])
    assert not eng.has_work and not eng.timeline and not eng.finished and not eng.logits
    assert world.runner.kv.free_slots == free
    mine = eng.add_request([1, 2, 3], None, max_new_tokens=2)
    eng.run()
    assert eng.finished == [mine] and len(mine.output) == 2 and mine.id == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_warm_up_gives_back_its_request_ids(world, overlap):
    """Requests served after it are numbered as on an engine that never warmed up (they were
    numbered past the warm-up's own, while the step indices started again at 0): with
    ``keep_logits`` the first request's logits are ``engine.logits[0]``."""
    eng = world.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16), overlap=overlap)
    first = eng.add_request([1, 2, 3], None, max_new_tokens=2)
    eng.run()
    assert eng.warm_up().steps > 0
    second = eng.add_request([4, 5], None, max_new_tokens=2)
    eng.run()
    assert (first.id, second.id) == (0, 1) and sorted(eng.logits) == [0, 1]
    assert [s.index for s in eng.timeline] == list(range(len(eng.timeline)))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Triton compiles only on a GPU")
def test_no_step_compiles_after_the_warm_up():
    w = EngineWorld("triton", "cuda", dtype=torch.bfloat16, graphs=True, kv_tokens=400)
    eng = w.engine(SchedulerConfig(max_batch_size=12, max_step_tokens=64))
    names = [w.new_adapter(eng) for _ in range(2)]
    report = eng.warm_up()
    assert report.compiles is not None
    g = torch.Generator().manual_seed(11)
    for i in range(24):
        plen = int(torch.randint(1, 60, (1,), generator=g))
        prompt = torch.randint(0, w.config.vocab_size, (plen,), generator=g).tolist()
        eng.add_request(prompt, [None, *names][i % 3], max_new_tokens=int(1 + i % 9))
    eng.run()
    compiled = [(s.index, s.mode, s.tokens, s.batch_size, s.compiles) for s in eng.timeline
                if s.compiles]
    assert not compiled, f"steps compiled kernels after the warm-up: {compiled}"
