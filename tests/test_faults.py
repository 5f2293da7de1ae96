"""Faults in the middle of an operation leave nothing stale behind: a slot write that fails
after zeroing its slot leaves the slot without an owner (its old adapter is written again
when next used, never served half-written); a step whose build or forward raises (a layer,
a graph replay, a KV allocation, an interrupt) gives back the KV slots its build took and
resets the LoRA batch, so the engine serves every request as if the fault had not happened;
a capture that fails leaves no graph, and batches run eagerly."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld, run_alone
from runtime_helpers import drawn_adapter

from graphs import GraphRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.engine.scheduler import SchedulerConfig


class Boom(Exception):
    pass


def _fail_at(monkeypatch, obj, attr: str, at: int, exc=Boom) -> None:
    """``obj.attr``'s ``at``-th call raises ``exc``; the others run."""
    real, calls = getattr(obj, attr), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise exc(f"{attr} call {at}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, attr, wrapper)


def test_a_failed_slot_write_never_serves_the_half_written_slot(monkeypatch):
    w = EngineWorld("torch", DEVICE, layers=2, slots=2)
    eng = w.engine(SchedulerConfig())
    a, b, c = (w.new_adapter(eng) for _ in range(3))
    prompt = [5, 9, 2, 7, 1, 3]

    def last_logits(name):
        r = Request(list(prompt), name, 1)
        out = w.runner.forward_eager(build_extend([r], w.runner.kv, DEVICE))[0].clone()
        release([r], w.runner.kv)
        w.lora.reset_lora_batch()
        return out

    last_logits(a), last_logits(b)
    with monkeypatch.context() as m:
        _fail_at(m, torch, "_foreach_copy_", 1)  # c's write into a's slot, after its zeroing
        with pytest.raises(Boom):
            last_logits(c)
    assert a not in w.lora.pool.slot_of and None in w.lora.pool.owner
    want = run_alone(w.ref, w.adapters, prompt, a, [0])[0]
    torch.testing.assert_close(last_logits(a), want, rtol=1e-4, atol=1e-4)
    loaded = set(w.lora.adapters)
    d = drawn_adapter(w.config, "pinned", 77, max_rank=8)
    with monkeypatch.context() as m:
        _fail_at(m, torch, "_foreach_copy_", 1)
        with pytest.raises(Boom):
            w.lora.load_adapter("pinned", d, pinned=True)
    assert set(w.lora.adapters) == loaded and not w.lora.pool.pinned
    w.lora.load_adapter("pinned", d, pinned=True)  # the retry finds nothing half-done
    assert "pinned" in w.lora.pool.slot_of


@pytest.mark.parametrize("where, at, graphs, overlap", [
    ("forward", 1, False, False),   # the first chunk of a long prompt
    ("forward", 2, False, True),    # the step launched ahead
    ("replay", 2, True, False),
    ("replay", 3, True, True),
    ("alloc", 2, False, False),     # a prefill's second request: the first already took slots
    ("alloc", 4, False, True),
    ("interrupt", 3, False, True),
])
def test_a_step_that_raises_leaves_the_engine_serving_correctly(monkeypatch, where, at,
                                                                 graphs, overlap):
    w = EngineWorld("torch", DEVICE, layers=1, graphs=graphs)
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=8), overlap=overlap)
    name = w.new_adapter(eng)
    g = torch.Generator().manual_seed(1)
    reqs = [eng.add_request(torch.randint(0, w.config.vocab_size, (n,), generator=g).tolist(),
                            adapter, max_new_tokens=4)
            for n, adapter in ((20, name), (5, None), (6, name))]
    obj, attr, exc = {"forward": (w.runner, "forward_eager", Boom),
                      "replay": (GraphRunner, "replay", Boom),
                      "alloc": (w.runner.kv, "alloc", Boom),
                      "interrupt": (w.runner, "forward_eager", KeyboardInterrupt)}[where]
    raised = 0
    with monkeypatch.context() as m:
        _fail_at(m, obj, attr, at, exc)
        while eng.has_work:
            try:
                eng.step()
            except (Boom, KeyboardInterrupt):
                raised += 1
                assert w.lora.backend.batch_info is None
    assert raised == 1
    for r in reqs:
        assert len(r.output) == 4
        w.check_request(eng, r)
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_a_failed_capture_leaves_no_graph_and_batches_run_eagerly(monkeypatch):
    w = EngineWorld("torch", DEVICE, layers=1)
    runner = GraphRunner.decode(w.runner, [1, 2, 4], 48)
    import graphs.runner as runner_module

    _fail_at(monkeypatch, runner_module, "capture", 3)
    with pytest.raises(Boom):
        runner.capture()
    assert not runner.graphs and w.lora.backend.batch_info is None
    eng = w.engine(SchedulerConfig(max_batch_size=4))
    eng.graphs = [runner]
    name = w.new_adapter(eng)
    req = eng.add_request([4, 8, 15, 16], name, max_new_tokens=3)
    eng.run()
    assert not any(s.graph for s in eng.timeline)
    w.check_request(eng, req)
