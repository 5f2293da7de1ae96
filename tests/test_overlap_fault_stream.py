"""A step launched ahead that raises finishes the step in flight first: its tokens reach the
requests' ``output`` and must also reach the stream, i.e. come back from a later ``step()``
(a client streaming ``step()``'s pairs would otherwise never see them)."""

from __future__ import annotations

import pytest
from conftest import DEVICE
from engine_world import EngineWorld, stream_through

from lora_runtime.engine.scheduler import SchedulerConfig


class Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [2, 3])  # the decode run ahead of the prefill, of a decode
def test_tokens_finished_before_a_raising_step_ahead_are_streamed(monkeypatch, fail_at):
    w = EngineWorld("torch", DEVICE, layers=1)
    eng = w.engine(SchedulerConfig(max_batch_size=2, max_step_tokens=16), overlap=True)
    reqs = [eng.add_request([5, 9, 2, 7], None, max_new_tokens=5),
            eng.add_request([3, 1, 4], None, max_new_tokens=5)]
    real, calls = w.runner.forward_eager, [0]

    def flaky(batch):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Boom("the step launched ahead fails")
        return real(batch)

    monkeypatch.setattr(w.runner, "forward_eager", flaky)
    streamed, raised = stream_through(eng, Boom)
    assert raised == 1
    for r in reqs:
        assert len(r.output) == 5
        assert streamed[r.id] == r.output, "each token is returned by step() exactly once"
        w.check_request(eng, r)
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens
