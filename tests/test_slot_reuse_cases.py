"""Slot reuse: a graph replay (before any eager forward) right after an adapter's name is
reused with another rank, rank pattern, targets and alpha; a high-rank adapter then a low-rank
one in the same slot; pin/unpin while a batch is prepared; a batch using every slot; on a
2-layer world, an adapter covering layer 0 only beside one covering every layer, then replaced
in its slot by one covering layer 1 only. Each
replay is checked against eager and the merged dense model of the right adapter."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import DEVICE
from graph_harness import SLOTS, Harness, shared

from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.slot_pool import SlotPoolError

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
       "embed_tokens", "lm_head"]


@pytest.fixture(params=["torch", "triton"])
def h(request):
    return shared(request.param, DEVICE).reset()


def _patterned(h, name, seed, ranks: dict[str, int], alpha: float):
    """An adapter with a rank per target (PEFT's rank_pattern)."""
    mods = {}
    for i, (t, r) in enumerate(ranks.items()):
        mods.update(random_adapter(h.config, name, r, [t], seed=seed + i, b_std=0.3,
                                   alpha=alpha).modules)
    base = random_adapter(h.config, name, max(ranks.values()), list(ranks), seed=seed)
    return dataclasses.replace(base, modules=mods, rank_pattern=dict(ranks))


def _replay_first(h, mix, seed, *, lens=None):
    """Prefill then decode of requests with adapters ``mix``: each step is replayed in its
    graph first (no eager forward before it), then run eagerly; both must equal the merged
    model of each request's adapter."""
    g = torch.Generator().manual_seed(seed)
    lens = lens or [3 + i % 2 for i in range(len(mix))]
    reqs = [Request(torch.randint(0, h.config.vocab_size, (n,), generator=g).tolist(),
                    None if a is None else a.name, 4) for n, a in zip(lens, mix, strict=True)]
    kv = h.runner.kv
    for build, graph in ((build_extend, h.prefill), (build_decode, h.decode)):
        batch = build(reqs, kv, DEVICE)
        assert graph.can_run(batch)
        got = graph.replay(batch).clone()
        for r, a, row in zip(reqs, mix, got, strict=True):
            h.oracle(r.tokens, a, row)
        eager = h.runner.forward_eager(batch)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        for r, row in zip(reqs, got, strict=True):
            r.output.append(int(row.argmax()))
    release(reqs, kv)
    h.lora.reset_lora_batch()


def test_name_reused_with_other_rank_pattern_targets_and_alpha(h):
    x = h.adapter("X", 8, ALL, seed=21, alpha=16.0)
    _replay_first(h, [x, None], seed=1)
    slot = h.lora.pool.slot_of["X"]
    h.lora.unload_adapter("X")
    x2 = _patterned(h, "X", 40, {"q_proj": 1, "v_proj": 3, "down_proj": 2, "lm_head": 5},
                    alpha=3.0)
    h.lora.load_adapter("X", x2)
    # The same batch shape and names: the static layouts hold its spec, the plan cache its key.
    _replay_first(h, [x2, None], seed=1)
    assert h.lora.pool.slot_of["X"] == slot
    h.assert_slot_holds(slot, x2)
    # Pinned reload under the same name, larger rank again.
    h.lora.unload_adapter("X")
    x3 = h.adapter("X", 6, ["o_proj", "embed_tokens"], seed=22, alpha=-2.0, pinned=True)
    _replay_first(h, [x3, None], seed=1)
    h.assert_slot_holds(h.lora.pool.slot_of["X"], x3)


def test_high_rank_then_low_rank_in_one_slot(h):
    """Stale columns of A/B past the new rank must not leak (merged float reference)."""
    hi = h.adapter("HI", 8, ALL, seed=30, alpha=64.0, pinned=True)
    _replay_first(h, [hi], seed=2)
    slot = h.lora.pool.slot_of["HI"]
    h.lora.unload_adapter("HI")
    lo = h.adapter("LO", 1, ALL, seed=31, alpha=1.0, pinned=True)
    assert h.lora.pool.slot_of["LO"] == slot
    _replay_first(h, [lo], seed=2)
    # The kernels could mask by rank and hide stale weights: check the slot's memory too.
    for (layer, module), w in h.lora.weights.items():
        if w.is_embedding:
            stale = w.lora_a[slot, :, 1:].any() or w.lora_b[slot, :, 1:].any()
        else:
            live = torch.zeros(w.lora_a.shape[1], dtype=torch.bool)
            live[:: w.max_rank] = True  # row 0 of each slice's A block
            stale = w.lora_a[slot][~live].any() or w.lora_b[slot, :, 1:].any()
        assert not stale, f"{layer} {module}: weights of HI past rank 1 left in the slot"


def test_eviction_between_prepares_and_pins_while_prepared(h):
    a, b, c, d = (h.adapter(n, 2 + i, ALL[i::2], seed=50 + i) for i, n in enumerate("ABCD"))
    _replay_first(h, [a, b, c], seed=3)  # every slot used by one batch
    assert len(h.lora.pool.slot_of) == SLOTS
    # D evicts the LRU one; A comes back (evicting another), all through replays.
    _replay_first(h, [d, None, b], seed=4)
    _replay_first(h, [a, d], seed=5)
    # Prepared batch [A, D]: pinning C must evict B (not A or D); the batch still serves.
    reqs = [Request([1, 2, 3], "A", 2), Request([4, 5], "D", 2)]
    batch = build_extend(reqs, h.runner.kv, DEVICE)
    h.lora.prepare_lora_batch(batch)
    h.lora.pin_adapter("C")
    assert set(h.lora.pool.slot_of) == {"A", "C", "D"}
    with pytest.raises(SlotPoolError):
        h.lora.pin_adapter("B")  # every slot is prepared or pinned
    assert set(h.lora.pool.slot_of) == {"A", "C", "D"}
    torch.testing.assert_close(h.runner.forward_eager(batch)[0],
                               h.reference(reqs[0].tokens, a), rtol=1e-4, atol=1e-4)
    release(reqs, h.runner.kv)
    h.lora.reset_lora_batch()
    _replay_first(h, [a, c, d], seed=6)
    h.lora.pin_adapter("C", False)
    _replay_first(h, [b, None, c], seed=7)  # C unpinned: now evictable, B takes A's or D's
    for n in ("B", "C"):
        h.assert_slot_holds(h.lora.pool.slot_of[n], {"B": b, "C": c}[n])


def test_same_decode_batch_after_its_adapter_is_reloaded_or_evicted(h):
    """The plan cache keys on the batch (mode, names, lengths): a decode step of the same
    requests after their adapter was unloaded and another loaded under its name, or after it
    was evicted, must move the adapter into a slot again (not reuse the old plan)."""
    x = h.adapter("X", 4, ALL, seed=70, alpha=8.0)
    reqs = [Request([5, 6, 7], "X", 6), Request([8, 9], None, 6)]
    kv = h.runner.kv
    h.prefill.replay(build_extend(reqs, kv, DEVICE))
    for r in reqs:
        r.output.append(1)

    def step():
        """One decode step, replayed then run eagerly on the same batch (equal logits)."""
        batch = build_decode(reqs, kv, DEVICE)
        got = h.decode.replay(batch).clone()
        torch.testing.assert_close(got, h.runner.forward_eager(batch), rtol=1e-4, atol=1e-4)
        for r in reqs:
            r.output.append(1)
        return got

    step()
    slot = h.lora.pool.slot_of["X"]
    h.assert_slot_holds(slot, x)
    h.lora.reset_lora_batch()
    h.lora.unload_adapter("X")
    x2 = h.adapter("X", 2, ["o_proj", "lm_head"], seed=71, alpha=5.0)
    step()
    h.assert_slot_holds(h.lora.pool.slot_of["X"], x2)
    # Evicted in between by pins of three others, then the same decode step again.
    h.lora.reset_lora_batch()
    others = [h.adapter(n, 3, ["q_proj"], seed=72 + i) for i, n in enumerate("UVW")]
    for o in others:
        h.lora.pin_adapter(o.name)
    assert "X" not in h.lora.pool.slot_of
    for o in others:
        h.lora.pin_adapter(o.name, False)
    step()
    h.assert_slot_holds(h.lora.pool.slot_of["X"], x2)
    # Pinning while this batch is prepared must not evict X.
    for o in others[:2]:
        h.lora.pin_adapter(o.name)
    assert "X" in h.lora.pool.slot_of
    with pytest.raises(SlotPoolError):
        h.lora.pin_adapter(others[2].name)
    h.assert_slot_holds(h.lora.pool.slot_of["X"], x2)
    step()
    release(reqs, kv)


def test_a_gathered_layout_that_does_not_fit_changes_no_slot(h):
    """A DP step whose gathered rows exceed the agreed rows per rank is refused before any
    slot is written: the prepared batch's adapters keep their slots (its metadata still
    names them)."""
    import dataclasses as dc

    from lora_runtime.engine.forward_batch import ForwardMode, GatheredRows

    a, b, c, d = (h.adapter(n, 2, ["q_proj"], seed=80 + i) for i, n in enumerate("ABCD"))
    h.lora.pin_adapter("C")
    h.lora.pin_adapter("C", False)
    reqs = [Request([1, 2, 3], "A", 2), Request([4, 5], "B", 2)]
    batch = build_extend(reqs, h.runner.kv, DEVICE)
    h.lora.prepare_lora_batch(batch)  # slots: C, A, B; B least recent but C older
    h.lora.pin_adapter("C")  # now only B may be evicted for D
    owners, writes = list(h.lora.pool.owner), h.lora.writer.writes
    other = [Request([6, 7, 8], "A", 2), Request([9, 10], "D", 2)]
    bad = dc.replace(build_extend(other, h.runner.kv, DEVICE), gathered=GatheredRows(
        ForwardMode.EXTEND, 2, (("A", "D"), ()), ((3, 2), ())))  # rank 0: 5 rows > 2
    with pytest.raises(ValueError, match="rows per rank"):
        h.lora.prepare_lora_batch(bad)
    assert h.lora.writer.writes == writes and h.lora.pool.owner == owners, \
        "a refused plan moved an adapter of the prepared batch out of its slot"
    h.assert_slot_holds(h.lora.pool.slot_of["B"], b)
    release(reqs + other, h.runner.kv)


@functools.cache
def _two_layer_world() -> Harness:
    return Harness("torch", DEVICE, decode_buckets=[4], max_context=16, prefill_buckets=[32],
                   max_requests=4, slots=2, layers=2)


def _only_layer(h, name, layer, rank, seed, alpha):
    ad = random_adapter(h.config, name, rank, ALL, seed=seed, b_std=0.3, alpha=alpha)
    mods = {k: m for k, m in ad.modules.items() if k[0] in (None, layer)}
    return dataclasses.replace(ad, modules=mods)


def test_partial_layer_adapter_beside_a_full_one_and_replaced():
    h = _two_layer_world().reset()
    full = h.adapter("F", 3, ALL, seed=60, alpha=6.0)
    p0 = _only_layer(h, "P", 0, 8, seed=61, alpha=24.0)
    h.lora.load_adapter("P", p0)
    # Both slots used: max_loras_per_batch exactly.
    _replay_first(h, [p0, full, None], seed=1, lens=[4, 5, 6])
    slot = h.lora.pool.slot_of["P"]
    h.lora.unload_adapter("P")
    p1 = _only_layer(h, "P", 1, 2, seed=62, alpha=1.5)
    h.lora.load_adapter("P", p1)
    _replay_first(h, [p1, full, None], seed=1, lens=[4, 5, 6])
    assert h.lora.pool.slot_of["P"] == slot
    h.assert_slot_holds(slot, p1)
    # A new name takes F's slot (LRU after touching P): the full adapter's layer 1 must go.
    h.lora.pin_adapter("P")
    h.lora.pin_adapter("P", False)
    q = _only_layer(h, "Q", 0, 5, seed=63, alpha=5.0)
    h.lora.load_adapter("Q", q)
    _replay_first(h, [None, q, p1], seed=2, lens=[4, 5, 6])
    h.assert_slot_holds(h.lora.pool.slot_of["Q"], q)


def test_a_step_agreed_on_other_rows_per_rank_is_refused_before_any_write(h):
    """A replay whose gathered rows (a DP step's agreement; here a group of one) name another
    row count than the bucket's is refused before any static buffer or slot is written;
    with the bucket's it replays as the plain batch does."""
    from lora_runtime.engine.forward_batch import ForwardMode, GatheredRows

    h.adapter("A", 3, ["q_proj", "down_proj"], seed=90)
    reqs = [Request([1, 2, 3], "A", 2), Request([4, 5], None, 2)]
    build_extend(reqs, h.runner.kv, DEVICE)
    for r in reqs:
        r.output.append(6)
    batch = build_decode(reqs, h.runner.kv, DEVICE)
    eager = h.runner.forward_eager(batch).clone()
    h.lora.reset_lora_batch()
    bucket = h.decode.bucket_for(batch)
    agreed = lambda rows: dataclasses.replace(batch, gathered=GatheredRows(  # noqa: E731
        ForwardMode.DECODE, rows, (("A", None),), ((1, 1),)))
    before = [t.clone() for t in (*h.decode.buffers._static, h.decode.lora_buffers.tokens._buf)]
    writes = h.lora.writer.writes
    with pytest.raises(ValueError, match=f"agreed on 2 rows per rank but bucket {bucket}"):
        h.decode.replay(agreed(2))
    after = (*h.decode.buffers._static, h.decode.lora_buffers.tokens._buf)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert h.lora.backend.batch_info is None and h.lora.writer.writes == writes
    torch.testing.assert_close(h.decode.replay(agreed(bucket)), eager, rtol=1e-4, atol=1e-4)
    release(reqs, h.runner.kv)
