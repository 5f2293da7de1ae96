"""Adapter-slot reuse, deterministically (issue 7, "Test strength"): with the pool full,
(a) the LRU adapter is evicted and replaced by one of the same rank and weights but another
alpha (only the scalings differ); (c) an adapter that holds no slot (evicted earlier) is
unloaded, then a new adapter loaded and served; (b) an adapter that targeted q, k, v and
gate_proj is replaced by one that targets only o_proj, down_proj, embed_tokens and lm_head
(its slot must hold rank 0 for the modules the new adapter lacks). After each: the slot's
rank/scaling tables hold the new adapter's values, and eager forwards and graph replays
(prefill, then decode) equal the merged dense model of the right adapter. Both backends.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from graph_harness import SLOTS, shared

from lora_runtime.engine.requests import Request, build_decode, build_extend, release

QKVG = ["q_proj", "k_proj", "v_proj", "gate_proj"]
OTHERS = ["o_proj", "down_proj", "embed_tokens", "lm_head"]


@pytest.fixture(params=["torch", "triton"])
def h(request):
    return shared(request.param, DEVICE).reset()


def _touch(h, *names):
    """Uses adapters in this order (each takes a slot and becomes most recent), no forward."""
    for n in names:
        h.lora.pin_adapter(n)
        h.lora.pin_adapter(n, False)


def _serve(h, mix, seed):
    """A prefill then a decode of requests with adapters ``mix`` (LoRAAdapter or None), each
    replayed in its graph and checked against eager and every request against the merged
    model of its adapter."""
    g = torch.Generator().manual_seed(seed)
    reqs = [Request(torch.randint(0, h.config.vocab_size, (3 + i % 2,), generator=g).tolist(),
                    None if a is None else a.name, 4) for i, a in enumerate(mix)]
    kv = h.runner.kv
    for build in (build_extend, build_decode):
        logits = h.step(build(reqs, kv, DEVICE), expect_bucket=16 if build is build_extend else 24)
        for r, a, row in zip(reqs, mix, logits, strict=True):
            h.oracle(r.tokens, a, row)
            r.output.append(int(row.argmax()))
    release(reqs, kv)
    h.lora.reset_lora_batch()  # the batch is done: its adapters may be evicted
    return reqs


def test_reused_slots_hold_the_new_adapter(h):
    pool = h.lora.pool
    assert pool.num_slots == SLOTS == 3
    p = h.adapter("P", 4, QKVG, seed=10, alpha=8.0)
    q = h.adapter("Q", 2, QKVG + OTHERS + ["up_proj"], seed=11)
    r = h.adapter("R", 3, ["o_proj", "up_proj"], seed=12)
    _touch(h, "P", "Q", "R")  # pool full, P least recently used
    old = pool.slot_of["P"]

    # (a) same rank, same weights, another alpha: only the scalings differ.
    p2 = h.adapter("P2", 4, QKVG, seed=10, alpha=2.0)
    _serve(h, [p2, None, q], seed=1)
    assert pool.slot_of.get("P2") == old and "P" not in pool.slot_of
    h.assert_slot_holds(old, p2)
    tokens = list(range(3, 11))
    assert not torch.allclose(h.reference(tokens, p2), h.reference(tokens, p), atol=1e-2), \
        "the scenario needs P and P2 to give different logits"

    # (c) P holds no slot now: unloading it must change no slot; then a new adapter.
    before = {s: h.slot_tables(s) for s in range(SLOTS)}
    owners = list(pool.owner)
    h.lora.unload_adapter("P")
    assert pool.owner == owners
    assert {s: h.slot_tables(s) for s in range(SLOTS)} == before
    e = h.adapter("E", 5, ["q_proj", "up_proj", "lm_head"], seed=13, alpha=7.0)
    _touch(h, "P2", "Q")  # R is now the least recently used
    r_slot = pool.slot_of["R"]
    _serve(h, [e, p2, None, q], seed=2)
    assert pool.slot_of.get("E") == r_slot and "R" not in pool.slot_of
    h.assert_slot_holds(r_slot, e)
    for a in (p2, q):
        h.assert_slot_holds(pool.slot_of[a.name], a)

    # (b) P2 (q, k, v, gate_proj) replaced by D (o_proj, down_proj, embed_tokens, lm_head).
    _touch(h, "Q", "E")
    d = h.adapter("D", 4, OTHERS, seed=14, alpha=5.0)
    _serve(h, [None, d, e, r], seed=3)  # R comes back too: it evicts Q
    assert pool.slot_of.get("D") == old and "P2" not in pool.slot_of
    h.assert_slot_holds(old, d)
    tables = h.slot_tables(old)
    assert all(tables[(0, t)][0] == 0 for t in QKVG), "modules D lacks must be rank 0"
    for a in (e, r):
        h.assert_slot_holds(pool.slot_of[a.name], a)
