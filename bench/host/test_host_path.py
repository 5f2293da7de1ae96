"""The host path of a decode step, piece by piece and whole: what a step waits on before a
graph replay can launch. Host time only (no device synchronisation: the copies a CUDA step
queues run behind it). Each benchmark checks the result of what it timed once."""

from __future__ import annotations

import pytest

from bench.host import checks
from bench.host.world import HostWorld

STATEFUL_ROUNDS = 200
"""Rounds of the benchmarks that build a batch (each takes KV slots; a setup, untimed, gives
them back before the next round)."""


def _tag(benchmark, world: HostWorld, bs: int) -> None:
    s = world.shape
    benchmark.extra_info.update(device=world.device.type, bs=bs, adapters=s.adapters,
                                rank=s.rank, context=s.context)


def _check_lora_layouts(world: HostWorld, batch, tokens, logits, what: str) -> None:
    want = world.slots_of(batch)
    checks.check_device_layout(tokens, want, world.neutral_slot, f"{what} token rows")
    checks.check_device_layout(logits, want, world.neutral_slot, f"{what} logits rows")


def test_build_batch(benchmark, world: HostWorld, bs: int) -> None:
    """Scheduler step and ``build_decode``: running requests -> a decode ``ForwardBatch``."""
    _tag(benchmark, world, bs)
    batch = benchmark.pedantic(world.build_batch, args=(bs,), setup=lambda: world.unbuild(bs),
                               rounds=STATEFUL_ROUNDS, warmup_rounds=2)
    checks.check_decode_batch(batch, world.requests(bs))


PLAN_ROUNDS = 500


@pytest.mark.parametrize("cached", [False, True], ids=["planned", "cache_hit"])
def test_lora_plan(benchmark, world: HostWorld, bs: int, cached: bool) -> None:
    """``LoRAManager.plan_lora_batch``: slots (all resident) and the segment plans. ``planned``
    plans each round (the manager's cached plan of the last batch is dropped before it, in the
    untimed setup); ``cache_hit`` times the same batch again (a decode step of unchanged
    requests), which reuses that plan."""
    _tag(benchmark, world, bs)
    batch = world.build_batch(bs)

    def forget_last_plan() -> None:
        if not cached:
            world.lora._last_plan = None

    world.plan(batch)
    plan = benchmark.pedantic(world.plan, args=(batch,), setup=forget_last_plan,
                              rounds=PLAN_ROUNDS, warmup_rounds=2)
    want = world.slots_of(batch)
    checks.check_plan(plan.rows, want, world.neutral_slot, "plan token rows")
    checks.check_plan(plan.logits_rows, want, world.neutral_slot, "plan logits rows")


def test_lora_prepare_eager(benchmark, world: HostWorld, bs: int) -> None:
    """``LoRAManager.prepare_lora_batch``: plan and exact-size device metadata (eager step)."""
    _tag(benchmark, world, bs)
    batch = world.build_batch(bs)
    benchmark(world.prepare_eager, batch)
    _check_lora_layouts(world, batch, *world.eager_layouts(), "eager")


@pytest.mark.parametrize("batch_changed", [True, False], ids=["changed", "unchanged"])
def test_lora_buffer_refresh(benchmark, world: HostWorld, bs: int, batch_changed: bool) -> None:
    """A plan into the graph runner's static LoRA metadata (the LoRA "buffer refresh"):
    after a step of another layout (plan and copy), or of the same one (a decode step whose
    requests and adapters did not change: nothing to plan or copy)."""
    _tag(benchmark, world, bs)
    batch = world.build_batch(bs)
    plan = world.plan(batch)
    other = world.plan_with_slots_rotated(plan)
    turn = iter(range(1 << 62))

    def refresh() -> None:
        world.refresh_lora(other if batch_changed and next(turn) % 2 else plan, bs)

    benchmark(refresh)
    world.refresh_lora(plan, bs)
    _check_lora_layouts(world, batch, *(s.view(s.max_rows) for s in world.static_layouts()),
                        "static")


def test_input_buffer_refresh(benchmark, world: HostWorld, bs: int) -> None:
    """The batch into the decode graph's static inputs (ids, positions, KV table)."""
    _tag(benchmark, world, bs)
    batch = world.build_batch(bs)
    benchmark(world.refresh_inputs, batch, bs)
    checks.check_input_buffers(world.input_buffers, batch, bs)


def test_graph_step_host(benchmark, world: HostWorld, bs: int) -> None:
    """One graph decode step minus the replay: schedule, build, plan, both refreshes."""
    _tag(benchmark, world, bs)
    world.check_replay_matches_eager(world.build_batch(bs))

    def step():
        batch = world.build_batch(bs)
        world.graph_step(batch)
        return batch

    with world.replays_skipped():
        batch = benchmark.pedantic(step, setup=lambda: world.unbuild(bs),
                                   rounds=STATEFUL_ROUNDS, warmup_rounds=2)
    checks.check_decode_batch(batch, world.requests(bs))
    _check_lora_layouts(world, batch, *(s.view(s.max_rows) for s in world.static_layouts()),
                        "static")
    checks.check_input_buffers(world.input_buffers, batch, bs)
    assert world.replayed_lora_graph(bs), "the step did not take the LoRA graph of its bucket"


@pytest.mark.parametrize("waiting", [1_000, 10_000])
def test_admission_under_a_full_kv_cache(benchmark, waiting: int) -> None:
    """A scheduler step's admission with a long queue and no KV room (an offline batch of
    long requests): the scan over the waiting requests, none of which fits."""
    from lora_runtime.engine.requests import Request
    from lora_runtime.engine.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(max_batch_size=64), kv_capacity=16 * 6007, num_slots=8)
    s.running = [Request([1] * 8, adapter=f"a{i % 8}", max_new_tokens=6000) for i in range(16)]
    s.waiting.extend(Request([1] * 300, adapter=f"a{i % 8}", max_new_tokens=512)
                     for i in range(waiting))
    benchmark.extra_info.update(waiting=waiting)
    step = benchmark.pedantic(s.schedule, rounds=50, warmup_rounds=1)
    assert len(s.running) == 16 and len(s.waiting) == waiting, "a request was admitted"
    assert step is not None and len(step.requests) == 16
