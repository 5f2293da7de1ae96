"""Faults a streaming client meets on the overlapped engine: every token a request's
``output`` holds comes back from exactly one ``step()``, whichever wait an interrupt lands
in."""

from __future__ import annotations

import pytest
from conftest import DEVICE
from engine_world import EngineWorld, stream_through

from lora_runtime.engine import engine as engine_module
from lora_runtime.engine.scheduler import SchedulerConfig


def _stopping_prompt(w: EngineWorld, eng) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy tokens change after the first: (prompt, its tokens, the index of
    the first token not seen before it)."""
    for seed in range(20):
        prompt = [(7 * seed + 3 * i) % w.config.vocab_size for i in range(4)]
        probe = eng.generate([prompt], [None], max_new_tokens=6)[0]
        cut = next((i for i in range(1, 5) if probe[i] not in probe[:i]), None)
        if cut is not None:
            return prompt, probe, cut
    raise AssertionError("no prompt with a fresh token")


@pytest.mark.parametrize("waits", [("discarded",), ("stop", "discarded")])
def test_an_interrupt_reading_a_discarded_step_ahead_streams_the_stop_token(monkeypatch, waits):
    """A request samples a stop token while the step after it runs ahead; that step serves no
    one and is read within the same ``step()``, where the host waits for it (on a GPU, where
    Ctrl-C lands). An interrupt there dropped the tokens of the step just read: the stop
    token reached ``output`` but no ``step()`` returned it. ``stop``: the read of the step
    that samples the stop token is interrupted first (the next call reads it, then the
    discarded step)."""
    w = EngineWorld("torch", DEVICE, layers=1)
    eng = w.engine(SchedulerConfig(max_batch_size=2), overlap=True)
    prompt, probe, cut = _stopping_prompt(w, eng)
    interrupted = []

    class Event:  # stands in for a step's CUDA event (CPU steps have none)
        def __init__(self, step):
            self.step = step

        def synchronize(self) -> None:
            [r] = self.step.plan.requests
            wait = "discarded" if r.done else "stop" if len(r.output) == cut else None
            if wait in waits and wait not in interrupted:
                interrupted.append(wait)
                raise KeyboardInterrupt(f"Ctrl-C while the host waits for the {wait} step")

    real_launch = engine_module.Engine._launch

    def launch(self, *args, **kwargs):
        step = real_launch(self, *args, **kwargs)
        step.ready = Event(step)
        return step

    monkeypatch.setattr(engine_module.Engine, "_launch", launch)
    r = eng.add_request(prompt, None, max_new_tokens=6, stop_ids=(probe[cut],))
    streamed, raised = stream_through(eng, KeyboardInterrupt, max_calls=20)
    assert raised == len(waits) and tuple(interrupted) == waits
    assert r.output == probe[:cut + 1]
    assert streamed[r.id] == r.output, "each token is returned by step() exactly once"
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens
