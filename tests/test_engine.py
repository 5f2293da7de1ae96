"""The serving engine under random workloads: requests arrive while others run, adapters are
loaded, pinned, unloaded and evicted meanwhile; every request's logits at every sampled token
equal the same request run alone, KV capacity and adapter slots hold at every step, and every
request finishes."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU
from engine_world import EngineWorld
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_runtime.engine.scheduler import SchedulerConfig

EXAMPLES = {"torch": 8 if not ON_GPU else 25, "triton": 2 if not ON_GPU else 10}


@pytest.fixture(scope="module", params=["eager", "graphs"])
def world(request):
    return EngineWorld("torch", DEVICE, graphs=request.param == "graphs")


def _serve(w: EngineWorld, data, config: SchedulerConfig, max_requests: int) -> dict:
    """Draws a workload and serves it, mutating adapters between steps; returns counters."""
    eng = w.engine(config, overlap=data.draw(st.booleans()))
    w.serial = 0  # adapter names (drawn from below) and weights the same in every example
    for _ in range(3):
        w.new_adapter(eng)
    reqs, steps, stats = [], 0, {"graph_steps": 0, "compared": 0}
    every_third = tuple(range(0, w.config.vocab_size, 3))
    budget = 400

    def add():
        names = [None, *eng.lora.adapters]
        adapter = data.draw(st.sampled_from(names))
        plen = data.draw(st.integers(1, 20))
        prompt = data.draw(st.lists(st.integers(0, w.config.vocab_size - 1), min_size=plen,
                                    max_size=plen))
        stop = data.draw(st.sampled_from([(), (), every_third]))  # a third of tokens stop
        reqs.append(eng.add_request(prompt, adapter, max_new_tokens=data.draw(st.integers(1, 6)),
                                    stop_ids=stop))

    for _ in range(data.draw(st.integers(1, 4))):
        add()
    while eng.has_work:
        steps += 1
        assert steps < budget, "the engine stopped making progress (a request starves)"
        action = data.draw(st.sampled_from(["step"] * 5 + ["add", "load", "pin", "unload"]))
        if action == "add" and len(reqs) < max_requests:
            add()
        elif action == "load" and len(eng.lora.adapters) < 7:
            w.new_adapter(eng)
        elif action == "pin" and eng.lora.adapters:  # every adapter may have been unloaded
            cand = sorted(eng.lora.adapters)
            name = data.draw(st.sampled_from(cand))
            try:
                eng.pin_adapter(name, name not in eng.lora.pool.pinned)
            except ValueError as e:
                assert "slots" in str(e)
        elif action == "unload":
            used = {r.adapter for r in reqs if r.metrics.finish is None}
            free = sorted(n for n in eng.lora.adapters if n not in used)
            if free:
                eng.unload_adapter(data.draw(st.sampled_from(free)))
        _check_invariants(w, eng)
        try:
            eng.step()
        except RuntimeError as e:  # pins took every slot a waiting request could use
            assert "can never be admitted" in str(e) and eng.lora.pool.pinned, e
            for name in list(eng.lora.pool.pinned):
                eng.pin_adapter(name, False)  # the fix the message names; serving goes on
    for r in reqs:
        assert r.metrics.finish is not None and len(r.output) >= 1
        assert len(r.output) == r.max_new_tokens or r.output[-1] in r.stop_ids
        stats["compared"] += w.check_request(eng, r)
    stats["graph_steps"] = sum(s.graph for s in eng.timeline)
    for s in eng.timeline:
        assert len(set(s.adapters)) <= w.slots
    assert w.runner.kv.free_slots == w.runner.kv.max_tokens, "finished requests free their cache"
    return stats


def _check_invariants(w: EngineWorld, eng) -> None:
    sched = eng.scheduler
    assert sched.reserved() <= w.runner.kv.max_tokens
    assert len(sched.running_adapters() | set(eng.lora.pool.pinned)) <= w.slots
    slots = [s for r in sched.running for s in r.kv_slots]
    assert len(slots) == len(set(slots)), "two requests share a KV slot"
    assert len(sched.running) <= eng.config.max_batch_size


def test_engine_matches_requests_run_alone(world, capsys):
    totals = {"graph_steps": 0, "compared": 0, "examples": 0}

    @settings(max_examples=EXAMPLES["torch"], deadline=None, database=None)
    @given(data=st.data())
    def run(data):
        chunked = data.draw(st.booleans())
        config = SchedulerConfig(max_batch_size=data.draw(st.integers(1, 6)),
                                 max_step_tokens=data.draw(st.integers(4 if chunked else 20, 40)),
                                 chunked_prefill=chunked,
                                 max_overtake_steps=data.draw(st.integers(0, 8)))
        s = _serve(world, data, config, max_requests=10)
        totals["graph_steps"] += s["graph_steps"]
        totals["compared"] += s["compared"]
        totals["examples"] += 1

    run()
    with capsys.disabled():
        print(f"\n[engine] graphs={bool(world.graphs)} examples={totals['examples']} "
              f"graph steps={totals['graph_steps']} greedy tokens compared={totals['compared']}")
    assert totals["compared"] > 0
    if world.graphs:
        assert totals["graph_steps"] > 0, "the workloads must replay graphs"


@pytest.mark.slow
def test_engine_triton_backend_matches_alone():
    w = EngineWorld("triton", DEVICE, layers=1, graphs=True)
    eng = w.engine(SchedulerConfig(max_batch_size=4, max_step_tokens=12))
    names = [w.new_adapter(eng) for _ in range(3)]
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i, plen in enumerate((5, 17, 3, 9, 2)):
        prompt = torch.randint(0, w.config.vocab_size, (plen,), generator=g).tolist()
        reqs.append(eng.add_request(prompt, ([None] + names)[i % 4], max_new_tokens=3 + i % 2))
    eng.run()
    assert any(s.graph and s.variant == "lora" for s in eng.timeline)
    for r in reqs:
        w.check_request(eng, r)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_engine_bf16_cuda_graphs_match_alone(backend, capsys):
    """On the GPU: bf16, real CUDA graphs, a mixed workload with chunked prefill."""
    w = EngineWorld(backend, DEVICE, dtype=torch.bfloat16, layers=2, slots=3, kv_tokens=1024,
                    graphs=True)
    eng = w.engine(SchedulerConfig(max_batch_size=8, max_step_tokens=24))
    names = [w.new_adapter(eng) for _ in range(5)]
    g = torch.Generator().manual_seed(11)
    reqs = []
    for i in range(24):
        plen = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(0, w.config.vocab_size, (plen,), generator=g).tolist()
        reqs.append(eng.add_request(prompt, ([None] + names)[i % 6], max_new_tokens=2 + i % 7))
        if i % 3 == 2:
            eng.step()
    eng.run()
    compared = sum(w.check_request(eng, r) for r in reqs)
    graph_steps = sum(s.graph for s in eng.timeline)
    with capsys.disabled():
        print(f"\n[engine gpu] backend={backend} requests={len(reqs)} steps={len(eng.timeline)} "
              f"graph steps={graph_steps} tokens={sum(len(r.output) for r in reqs)} "
              f"greedy tokens compared (clear margin)={compared}")
    assert graph_steps > 0 and compared > 0
