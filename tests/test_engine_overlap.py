"""``Engine(overlap=True)``: the next step (a decode or a prefill) launched before this one's
tokens are read. The same workload served with and without overlap gives every request the
same tokens and logits (stop tokens included: a request that stops has its row of the step
run ahead discarded and its KV slots freed), decodes run ahead take each request's last token
from the device or the host as it was sampled, the steps run ahead are counted, and a pass's
step times add up to its wall time."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine import engine as engine_module
from lora_runtime.engine.scheduler import SchedulerConfig


def _serve(w: EngineWorld, overlap: bool, stops: dict[int, tuple[int, ...]]):
    eng = w.engine(SchedulerConfig(max_batch_size=3, max_step_tokens=16), overlap=overlap)
    w.serial = 0  # the same adapters (names, weights) in every run
    names = [w.new_adapter(eng) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(7):
        n = 2 + 3 * i % 7 if i != 3 else 27  # request 3's prompt takes two steps (chunks)
        prompt = torch.randint(0, w.config.vocab_size, (n,), generator=g).tolist()
        reqs.append(eng.add_request(prompt, ([None] + names)[i % 3], max_new_tokens=6 + i % 5,
                                    stop_ids=stops.get(i, ())))
    t0 = time.perf_counter()
    eng.run()
    wall = time.perf_counter() - t0
    return eng, reqs, wall


def test_overlap_serves_the_same_tokens_and_frees_the_cache(monkeypatch):
    w = EngineWorld("torch", DEVICE, layers=1)
    _, free_run, _ = _serve(w, overlap=False, stops={})
    # Odd requests stop at the token they sample third (or earlier, where it comes sooner).
    stops = {i: (r.output[2],) for i, r in enumerate(free_run) if i % 2}
    base, base_reqs, _ = _serve(w, overlap=False, stops=stops)
    ahead_rows = []  # (request, its tokens) in each decode run ahead, when it was launched
    mixed = []  # decodes run ahead with some tokens on the host, the others still pending
    continues = []  # per prefill built, in step order: does it continue a prompt's chunks?
    real, real_extend = engine_module.build_decode, engine_module.build_extend

    def build_decode(reqs, kv, device, pending=None, pending_rows=None):
        if pending is not None:
            ahead_rows.extend((r, len(r.output)) for r in reqs)
            if pending_rows is not None and min(pending_rows) < 0 <= max(pending_rows):
                mixed.append(pending_rows)
        return real(reqs, kv, device, pending, pending_rows)

    def build_extend(reqs, kv, device, limits=None):
        continues.append(any(0 < len(r.kv_slots) < len(r.prompt) for r in reqs))
        return real_extend(reqs, kv, device, limits)

    monkeypatch.setattr(engine_module, "build_decode", build_decode)
    monkeypatch.setattr(engine_module, "build_extend", build_extend)
    eng, reqs, wall = _serve(w, overlap=True, stops=stops)
    assert any(len(r.output) == n + 1 < r.max_new_tokens and r.output[-1] in r.stop_ids
               for r, n in ahead_rows), \
        "some request must stop while the step after it already runs (its row discarded)"
    assert mixed, "some decode run ahead must take tokens from the host and from the device"
    prefills = [s for s in eng.timeline if s.mode == "extend"]
    assert any(c and s.ahead for c, s in zip(continues, prefills, strict=True)), \
        "some prompt's next chunk must run ahead of the step that cached its first"
    for a, b in zip(base_reqs, reqs, strict=True):
        assert b.output == a.output, f"request {b.id}: {b.output} != {a.output}"
        for x, y in zip(base.logits[a.id], eng.logits[b.id], strict=True):
            torch.testing.assert_close(y, x)
        w.check_request(eng, b)
    assert any(r.output[-1] in r.stop_ids and len(r.output) < r.max_new_tokens for r in reqs), \
        "the workload must stop some request early"
    ahead = sum(s.ahead for s in eng.timeline)
    assert ahead > 0 and not any(s.ahead for s in base.timeline)
    assert {s.mode for s in eng.timeline if s.ahead} == {"decode", "extend"}
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens, "discarded rows free their slots"
    assert not eng.has_work
    total = sum(s.seconds for s in eng.timeline)
    assert total <= wall * 1.05 + 1e-3, "overlapped steps must not count their time twice"


def test_each_compile_is_counted_once_by_the_step_that_caused_it(monkeypatch):
    """A kernel compiled while launching the step run ahead belongs to that step, not also to
    the step in flight recorded after it (the throughput suite sums ``compiles``)."""
    w = EngineWorld("torch", DEVICE, layers=1)
    count = {"n": 0}
    monkeypatch.setattr(engine_module.jit_watch, "count", lambda: count["n"])
    real = w.runner.forward_eager

    def forward_eager(batch):  # every forward "compiles" one variant
        count["n"] += 1
        return real(batch)

    monkeypatch.setattr(w.runner, "forward_eager", forward_eager)
    for overlap in (False, True):
        count["n"] = 0
        eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16), overlap=overlap)
        for i in range(3):
            eng.add_request([1 + i, 2, 3], None, max_new_tokens=6)
        eng.run()
        assert [s.compiles for s in eng.timeline] == [1] * len(eng.timeline), overlap
        assert count["n"] == len(eng.timeline)
        assert overlap == any(s.ahead for s in eng.timeline)


def test_each_step_records_the_graph_it_replayed(monkeypatch):
    """The variant and bucket of a step are those its own replay ran, not those of the step
    launched ahead of its record (both replay the same runners)."""
    from graphs import GraphRunner

    w = EngineWorld("torch", DEVICE, layers=1, graphs=True)
    replays = []
    real = GraphRunner.replay

    def replay(self, batch, bucket=None, variant=None):
        out = real(self, batch, bucket, variant)
        replays.append((self.last_kind, self.last_bucket))
        return out

    monkeypatch.setattr(GraphRunner, "replay", replay)
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=16), overlap=True)
    name = w.new_adapter(eng)
    for i, (n, adapter) in enumerate([(3, None), (5, name), (2, None), (4, name), (6, None)]):
        eng.add_request(list(range(1, 2 + i)), adapter, max_new_tokens=n)
    eng.add_request(list(range(1, 21)), name, max_new_tokens=3)  # chunks of 16 and 4 rows
    eng.run()
    recorded = [(s.variant, s.bucket) for s in eng.timeline if s.graph]
    assert recorded == replays
    assert any(s.ahead for s in eng.timeline if s.graph)
    assert len(set(replays)) > 2, "the workload must replay several buckets and variants"


def test_a_step_ahead_that_serves_no_one_is_finished_at_once():
    """A request stops at a stop token while the step after it runs ahead: that step serves
    no one, so it is finished within the same ``step()``; left in flight, its record would take
    in the time until the caller's next step."""
    w = EngineWorld("torch", DEVICE, layers=1)
    eng = w.engine(SchedulerConfig(max_batch_size=2), overlap=True)
    for seed in range(20):  # a prompt whose greedy tokens change after the first
        prompt = [(7 * seed + 3 * i) % w.config.vocab_size for i in range(4)]
        probe = eng.generate([prompt], [None], max_new_tokens=6)[0]
        cut = next((i for i in range(1, 5) if probe[i] not in probe[:i]), None)
        if cut is not None:
            break
    steps = len(eng.timeline)
    r = eng.add_request(prompt, None, max_new_tokens=6, stop_ids=(probe[cut],))
    while r.metrics.finish is None:
        eng.step()
    assert r.output == probe[:cut + 1]
    assert not eng.has_work, "the discarded step must not stay in flight"
    assert any(s.ahead for s in eng.timeline[steps:])
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens


def test_overlap_is_fixed_at_construction():
    """Switched off while a step was in flight, every later step raised 'not ready to
    decode': the switch is refused, and the engine serves on as built."""
    w = EngineWorld("torch", DEVICE, layers=1)
    eng = w.engine(SchedulerConfig(max_batch_size=2), overlap=True)
    want = eng.generate([[3, 1, 4]], [None], max_new_tokens=5)[0]
    req = eng.add_request([3, 1, 4], None, max_new_tokens=5)
    eng.step()
    eng.step()
    with pytest.raises(AttributeError, match="fixed at construction"):
        eng.overlap = False
    assert eng.overlap is True
    eng.run()
    assert req.output == want
