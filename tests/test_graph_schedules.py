"""Property-based schedules: prefill, decode and idle steps with random adapter mixes (and
none), heterogeneous ranks, adapters loaded/unloaded/pinned/evicted between steps, batch sizes
crossing buckets. Every replay is compared with an eager forward of the same batch."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE, ON_GPU
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from schedule_world import MAX_CONTEXT, SLOTS, World

from lora_runtime.engine.requests import Request, build_decode, build_extend, release

# (examples, steps per example): 2,500 steps on the torch backend; the Triton interpreter
# is ~100x slower on CPU, so it gets fewer (the GPU runs many more).
BUDGET = {
    "torch": (50, 50),
    "triton": (2, 20) if not ON_GPU else (30, 40),
}
SCALE = float(os.environ.get("SCHEDULE_SCALE", "1"))
# Fault injection only needs to know that a schedule fails, not its smallest form.
PHASES = (Phase.explicit, Phase.generate) if os.environ.get("SCHEDULE_NO_SHRINK") else tuple(Phase)


def make_machine(world: World):
    class Schedule(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.w = world
            self.w.reset()
            self.active: list[Request] = []

        def teardown(self):
            release(self.active, self.w.runner.kv)
            self.w.lora.reset_lora_batch()

        def _fit(self, names):
            """The adapters of ``names`` that fit in the slots beside the pinned ones."""
            keep = set()
            for n in dict.fromkeys(x for x in names if x is not None):
                if len(keep | {n} | self.w.lora.pool.pinned) <= SLOTS:
                    keep.add(n)
            return keep

        def _pick_adapters(self, data, n):
            names = [None, *self.w.lora.adapters]
            picked = [data.draw(st.sampled_from(names)) for _ in range(n)]
            keep = self._fit(picked)
            return [p if p in keep else None for p in picked]

        @initialize(data=st.data())
        def first_prefill(self, data):
            """Every schedule starts with a replayed prefill that uses an adapter."""
            self.prefill(data, 2, force_adapter=True)

        @rule(data=st.data(), n=st.integers(1, 4))
        def prefill(self, data, n, force_adapter=False):
            lens = [data.draw(st.integers(1, 9)) for _ in range(n)]
            names = self._pick_adapters(data, n)
            if force_adapter and not any(names):
                names[0] = next(iter(self.w.lora.adapters))
            g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**30)))
            reqs = [Request(torch.randint(0, self.w.config.vocab_size, (k,), generator=g)
                            .tolist(), a, 64) for k, a in zip(lens, names, strict=True)]
            logits = self.w.check_step(build_extend(reqs, self.w.runner.kv, DEVICE))
            i = data.draw(st.integers(0, n - 1))
            self.w.check_oracle(reqs[i].tokens, reqs[i].adapter, logits[i])
            for r, row in zip(reqs, logits, strict=True):
                r.output.append(int(row.argmax()))
            self.active += reqs

        @precondition(lambda self: self.active)
        @rule(data=st.data())
        def decode(self, data):
            done = [r for r in self.active if len(r.tokens) >= MAX_CONTEXT + 2]
            release(done, self.w.runner.kv)
            self.active = [r for r in self.active if r not in done]
            if not self.active:
                return
            subset = data.draw(st.lists(st.sampled_from(self.active), min_size=1, max_size=10,
                                        unique_by=id))
            allowed = self._fit([r.adapter for r in subset])
            subset = [r for r in subset if r.adapter is None or r.adapter in allowed]
            logits = self.w.check_step(build_decode(subset, self.w.runner.kv, DEVICE))
            i = data.draw(st.integers(0, len(subset) - 1))
            self.w.check_oracle(subset[i].tokens, subset[i].adapter, logits[i])
            for r, row in zip(subset, logits, strict=True):
                r.output.append(int(row.argmax()))

        @rule()
        def idle(self):
            self.w.check_idle()

        @rule(data=st.data(), action=st.sampled_from(["load", "load_pinned", "unload",
                                                       "unpin", "finish"]))
        def manage(self, data, action):
            """Between steps: adapters come and go (evictions follow), requests finish."""
            lora = self.w.lora
            if action.startswith("load") and len(lora.adapters) < 8:
                pinned = action == "load_pinned" and len(lora.pool.pinned) < SLOTS - 1
                if pinned:
                    lora.reset_lora_batch()  # the last batch is done: its adapters may move
                self.w.new_adapter(seed=self.w.serial, pinned=pinned)
            elif action == "unload":
                used = {r.adapter for r in self.active}
                free = [n for n in lora.adapters if n not in used]
                if len(free) > 1:
                    lora.reset_lora_batch()
                    lora.unload_adapter(data.draw(st.sampled_from(free)))
            elif action == "unpin" and lora.pool.pinned:
                lora.pin_adapter(data.draw(st.sampled_from(sorted(lora.pool.pinned))), False)
            elif action == "finish" and self.active:
                done = data.draw(st.lists(st.sampled_from(self.active), max_size=3,
                                          unique_by=id))
                release(done, self.w.runner.kv)
                self.active = [r for r in self.active if r not in done]

    return Schedule


@pytest.fixture(scope="module", params=["torch", "triton"])
def world(request):
    layers = 1 if (request.param == "triton" and not ON_GPU) else 2
    return World(request.param, DEVICE, torch.float32, layers)


def test_every_replay_matches_eager(world, capsys):
    examples, steps = BUDGET[world.lora.backend.name]
    examples = max(1, int(examples * SCALE))
    machine = make_machine(world)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=steps,
                                   deadline=None, database=None, phases=PHASES))
    with capsys.disabled():
        print(f"\n[schedules] backend={world.lora.backend.name} device={DEVICE.type} "
              f"replays checked={world.replays} idle replays checked={world.idle_replays} "
              f"oracle checks={world.oracle_checks}")
    assert world.replays >= examples, "the schedules must actually replay graphs"
