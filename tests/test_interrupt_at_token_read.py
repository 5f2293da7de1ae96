"""An interrupt while the host waits for a step's tokens (on a GPU the host spends a step's
idle time there: ``tolist()`` serially, the pinned copy's event with overlap) leaves the engine
serving every request as if it had not happened, like an interrupt in the forward: before, the
step's KV slots stayed taken without its tokens, and every later ``step()`` raised "not ready
to decode" (overlap: one token skipped, then the same)."""

from __future__ import annotations

import pytest
from conftest import DEVICE
from engine_world import EngineWorld, stream_through

from lora_runtime.engine import engine as engine_module
from lora_runtime.engine.scheduler import SchedulerConfig


class _Event:
    """Stands in for the step's CUDA event; its ``at``-th wait is interrupted."""

    calls = 0
    at = 0

    def synchronize(self) -> None:
        _Event.calls += 1
        if _Event.calls == _Event.at:
            raise KeyboardInterrupt("Ctrl-C while the host waits for the step's tokens")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_interrupt_while_reading_tokens_leaves_the_engine_serving(monkeypatch, overlap, at):
    w = EngineWorld("torch", DEVICE, layers=1)
    eng = w.engine(SchedulerConfig(max_batch_size=2, max_step_tokens=16), overlap=overlap)
    name = w.new_adapter(eng)
    reqs = [eng.add_request([5, 9, 2, 7], name, max_new_tokens=5),
            eng.add_request([3, 1, 4], None, max_new_tokens=5)]
    if overlap:  # the wait on the step's event (CPU steps have none: give them one)
        _Event.calls, _Event.at = 0, at
        real_launch = engine_module.Engine._launch

        def launch(self, *args, **kwargs):
            step = real_launch(self, *args, **kwargs)
            step.ready = _Event()
            return step

        monkeypatch.setattr(engine_module.Engine, "_launch", launch)
    else:  # the serial step's read of its tokens
        real_sample, calls = engine_module.Engine._sample, [0]

        def sample(self, *args):
            calls[0] += 1
            if calls[0] == at:
                raise KeyboardInterrupt("Ctrl-C while the host waits for the step's tokens")
            return real_sample(self, *args)

        monkeypatch.setattr(engine_module.Engine, "_sample", sample)
    streamed, interrupted = stream_through(eng, KeyboardInterrupt, max_calls=50)
    assert interrupted == 1
    for r in reqs:
        assert len(r.output) == 5 and streamed[r.id] == r.output
        w.check_request(eng, r)
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_dp_refuses_to_step_on_after_an_interrupted_read():
    """Under DP a rank reading its interrupted step alone would desert its peers' collectives:
    it says so instead of stepping on (DP does not recover from faults)."""
    from types import SimpleNamespace

    from lora_runtime.dp.dp_engine import DPEngine

    eng = DPEngine.__new__(DPEngine)  # the guard runs before any collective
    eng.dp, eng._unread = SimpleNamespace(name="DP rank 0/2"), object()
    with pytest.raises(RuntimeError, match="DP rank 0/2: an interrupt .* restart every rank"):
        eng.step()
