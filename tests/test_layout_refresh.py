"""The static layouts' refresh skip: a layout whose buffer already holds a spec's plan is not
planned or copied again, and whatever sequence of batches, sizes and direct writes comes, the
buffer afterwards holds exactly what a fresh write of the last batch would hold (a skipped
refresh can never leave a previous batch's metadata behind)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.segments as segments
from kernels import SegmentSpec, StaticSegmentLayout
from lora_runtime.lora.backends.torch_backend import TorchBackend
from lora_runtime.lora.batch_info import LOGITS_BLOCK_M, LoRABatchPlan

SLOTS, NEUTRAL, BLOCK_M, MAX_ROWS = 3, 3, 4, 16


def _expected(plan, layout: StaticSegmentLayout) -> np.ndarray:
    return segments._pack(plan, layout.max_rows, layout.blocks_for(layout.max_rows), NEUTRAL)


def _spec(draw, rows: int) -> SegmentSpec:
    n = draw(st.integers(0, rows))
    slots = tuple(draw(st.lists(st.sampled_from([0, 1, NEUTRAL]), min_size=n, max_size=n)))
    return SegmentSpec(slots, None, BLOCK_M, NEUTRAL)


@settings(max_examples=60)
@given(data=st.data())
def test_any_sequence_leaves_the_last_batch_in_the_buffers(data):
    """Replays of the LoRA variant, of the peers variant (``local=False``: only the gathered
    layout is refreshed, the rank's own layouts keep what they held), idle replays and direct
    writes, in any order."""
    backend = TorchBackend(SLOTS, "cpu")
    buffers = backend.init_capture_buffers(MAX_ROWS, MAX_ROWS, BLOCK_M, dp_size=2)
    pool = [_spec(data.draw, MAX_ROWS) for _ in range(3)]  # few: repeats are the point
    want_rows = want_logits = want_gathered = None
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["replay", "replay", "peers", "idle", "direct"]))
        rows = data.draw(st.sampled_from([4, 8, MAX_ROWS]))
        if action == "direct":  # a write that names no spec (a capture does this)
            buffers.tokens.write(None, rows)
            want_rows = None
            continue
        local = action != "peers"
        if action == "idle":
            backend.prepare_for_replay(buffers, None, rows, rows)
            want_rows = want_logits = want_gathered = None
        else:
            spec = data.draw(st.sampled_from(pool))
            rows = max(rows, spec.num_rows)
            lens = tuple(data.draw(st.lists(st.integers(0, rows // 2), min_size=2,
                                            max_size=2)))
            gathered = SegmentSpec((0, NEUTRAL, 1, NEUTRAL), (lens[0], rows - lens[0],
                                                             lens[1], rows - lens[1]),
                                   BLOCK_M, NEUTRAL)
            plan = LoRABatchPlan(spec, _logits(spec), gathered)
            backend.prepare_for_replay(buffers, plan, rows, rows, local)
            if local:
                want_rows, want_logits = spec.plan(), _logits(spec).plan()
            want_gathered = gathered.plan()
        assert (backend.batch_info is None) is not local, "peers: no LoRA on the rank's rows"
        assert (backend.logits_info is None) is not local
        assert backend.gathered_info is not None
        for layout, want in ((buffers.tokens, want_rows), (buffers.logits, want_logits),
                             (buffers.gathered, want_gathered)):
            got = layout._buf.numpy()
            assert np.array_equal(got, _expected(want, layout)), "stale layout after a skip"


def test_the_peers_variant_needs_the_gathered_layout():
    backend = TorchBackend(SLOTS, "cpu")
    buffers = backend.init_capture_buffers(MAX_ROWS, MAX_ROWS, BLOCK_M)
    with pytest.raises(ValueError, match="gathered layout of DP attention"):
        backend.prepare_for_replay(buffers, None, 8, 8, local=False)


def test_a_refused_refresh_writes_no_buffer():
    """The logits view too small for the batch: refused before the token layout is written
    (it was rewritten, under a prepared batch that kept reading it, and held the new spec)."""
    backend = TorchBackend(SLOTS, "cpu")
    buffers = backend.init_capture_buffers(MAX_ROWS, MAX_ROWS, BLOCK_M, dp_size=2)
    spec = SegmentSpec((0, 1, 0, NEUTRAL), None, BLOCK_M, NEUTRAL)
    backend.prepare_for_replay(buffers, LoRABatchPlan(spec, _logits(spec)), 8, 8)
    before = [(b._buf.clone(), b._held) for b in vars(buffers).values()]
    info = backend.batch_info
    other = SegmentSpec((1, 1, 0), None, BLOCK_M, NEUTRAL)
    gathered = SegmentSpec((1, NEUTRAL), (3, 5), BLOCK_M, NEUTRAL)
    with pytest.raises(ValueError, match="1-row view"):
        backend.prepare_for_replay(buffers, LoRABatchPlan(other, _logits(other), gathered), 8, 1)
    for layout, (buf, held) in zip(vars(buffers).values(), before, strict=True):
        assert torch.equal(layout._buf, buf) and layout._held == held
    assert backend.batch_info is info


def _logits(spec: SegmentSpec) -> SegmentSpec:
    return dataclasses.replace(spec, block_m=LOGITS_BLOCK_M)


def test_a_held_layout_is_neither_planned_nor_copied(monkeypatch):
    backend = TorchBackend(SLOTS, "cpu")
    buffers = backend.init_capture_buffers(MAX_ROWS, MAX_ROWS, BLOCK_M)
    spec = SegmentSpec((0, 1, 0, NEUTRAL), None, BLOCK_M, NEUTRAL)
    backend.prepare_for_replay(buffers, LoRABatchPlan(spec, _logits(spec)), 8, 8)
    calls = []
    monkeypatch.setattr(segments, "plan_segments",
                        lambda *a, **k: calls.append(a) or pytest.fail("planned again"))
    monkeypatch.setattr(StaticSegmentLayout, "write",
                        lambda *a, **k: pytest.fail("copied again"))
    backend.prepare_for_replay(buffers, LoRABatchPlan(spec, _logits(spec)), 8, 8)
    backend.prepare_for_replay(buffers, LoRABatchPlan(spec, _logits(spec)), MAX_ROWS, MAX_ROWS)
    assert backend.batch_info.rows.num_rows == MAX_ROWS and not calls


def _layout_lists(layout) -> list[list[int]]:
    return [getattr(layout, t).tolist() for t in
            ("token_slots", "permutation", "block_slots", "block_starts", "block_ends")]


@settings(max_examples=40)
@given(data=st.data())
def test_eager_layouts_reused_only_for_an_equal_batch(data):
    """Eager prepares in any order, with repeats and more distinct batches than the backend
    keeps: every forward's layouts equal a fresh build of its own plan, and a batch equal to
    a kept one reuses its device layouts (no planning, no copy)."""
    from lora_runtime.lora.backends import base

    backend = TorchBackend(SLOTS, "cpu")
    pool = [_spec(data.draw, MAX_ROWS) for _ in range(base.EAGER_LAYOUTS_KEPT + 2)]
    seen: dict[SegmentSpec, object] = {}
    for _ in range(data.draw(st.integers(1, 12))):
        spec = data.draw(st.sampled_from(pool))
        plan = LoRABatchPlan(spec, _logits(spec))
        backend.prepare(plan)
        rows = backend.batch_info.rows
        assert _layout_lists(rows) == _layout_lists(segments.SegmentLayout.from_plan(
            spec.plan(), "cpu")), "an eager layout that is not its batch's own"
        assert _layout_lists(backend.logits_info) == _layout_lists(
            segments.SegmentLayout.from_plan(_logits(spec).plan(), "cpu"))
        if spec in seen and seen[spec] is rows:
            assert "rows" not in plan.__dict__, "a reused layout was planned again"
        seen[spec] = rows
        backend.reset_batch_state()
        assert backend.batch_info is None and backend.logits_info is None


def test_an_equal_eager_batch_is_neither_planned_nor_copied(monkeypatch):
    backend = TorchBackend(SLOTS, "cpu")
    spec = SegmentSpec((0, 1, 0, NEUTRAL), None, BLOCK_M, NEUTRAL)
    backend.prepare(LoRABatchPlan(spec, _logits(spec)))
    first = backend.batch_info.rows
    backend.reset_batch_state()
    monkeypatch.setattr(segments, "plan_segments", lambda *a, **k: pytest.fail("planned"))
    monkeypatch.setattr(segments.SegmentLayout, "from_plans",
                        lambda *a, **k: pytest.fail("copied again"))
    backend.prepare(LoRABatchPlan(spec, _logits(spec)))
    assert backend.batch_info.rows is first
    other = SegmentSpec((1, 0, 0, NEUTRAL), None, BLOCK_M, NEUTRAL)
    with pytest.raises(pytest.fail.Exception, match="planned|copied"):
        backend.prepare(LoRABatchPlan(other, _logits(other)))


def test_holds_names_the_spec_and_a_view_it_fits():
    layout = StaticSegmentLayout(MAX_ROWS, SLOTS + 1, BLOCK_M, NEUTRAL, "cpu")
    spec = SegmentSpec((0,) * 9, None, BLOCK_M, NEUTRAL)
    assert not layout.holds(spec, MAX_ROWS), "a fresh layout holds no spec"
    layout.write(spec.plan(), MAX_ROWS, spec)
    assert layout.holds(spec, MAX_ROWS) and layout.holds(spec, 9)
    assert not layout.holds(spec, 8), "9 rows do not fit an 8-row view"
    assert not layout.holds(SegmentSpec((1,) * 9, None, BLOCK_M, NEUTRAL), MAX_ROWS)
    layout.write(spec.plan(), MAX_ROWS)
    assert not layout.holds(spec, MAX_ROWS), "a write without its spec forgets the held one"


@settings(max_examples=80)
@given(data=st.data())
def test_a_view_has_no_more_blocks_than_rows_and_fits_every_plan(data):
    """The grid of every LoRA kernel is the view's block count: never more blocks than rows
    (a one-row decode graph launches one block however many slots the pool has), and every
    plan of that many rows fits (written through the view, read back as planned)."""
    slots = data.draw(st.integers(1, 70))
    block_m = data.draw(st.sampled_from([1, 4, 16]))
    max_rows = data.draw(st.integers(1, 40))
    layout = StaticSegmentLayout(max_rows, slots + 1, block_m, slots, "cpu")
    rows = data.draw(st.integers(0, max_rows))
    lens = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=8)))
    n = rows if lens is None else len(lens)
    if lens is not None and sum(lens) > rows:
        lens = None
        n = rows
    request_slots = data.draw(st.lists(st.integers(0, slots), min_size=n, max_size=n))
    spec = SegmentSpec(tuple(request_slots), None if lens is None else tuple(lens), block_m,
                       slots)
    plan = spec.plan()
    view = layout.view(rows)
    assert view.block_slots.shape[0] <= rows
    assert layout.blocks_for(1) == 1
    assert len(plan.blocks) <= view.block_slots.shape[0]
    layout.write(plan, rows, spec)
    used = len(plan.blocks)
    got = np.stack([view.block_slots.numpy(), view.block_starts.numpy(),
                    view.block_ends.numpy()])[:, :used].T
    assert [tuple(b) for b in got] == [tuple(b) for b in plan.blocks]
    assert (view.block_starts.numpy()[used:] == view.block_ends.numpy()[used:]).all()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=0, max_size=9),
                          st.sampled_from([1, 4, 16])), min_size=1, max_size=3))
def test_layouts_of_several_plans_share_one_aligned_buffer(specs):
    """An eager forward's layouts come from one copy: each equals its plan, and every part
    starts 16 bytes into the buffer (Triton specialises on pointer alignment)."""
    plans = [segments.plan_segments(slots, None, block_m=bm) for slots, bm in specs]
    layouts = segments.SegmentLayout.from_plans(plans, "cpu")
    bases = {lay.token_slots.untyped_storage().data_ptr() for lay in layouts}
    assert len(bases) == 1
    for plan, lay in zip(plans, layouts, strict=True):
        assert lay.token_slots.tolist() == list(plan.token_slots)
        assert lay.block_m == plan.block_m
        starts = [b[1] for b in plan.blocks]
        assert lay.block_starts.tolist() == starts
        assert lay.block_slots.tolist() == [b[0] for b in plan.blocks]
        assert lay.block_ends.tolist() == [b[2] for b in plan.blocks]
        assert lay.permutation.tolist() == list(plan.permutation)
        for t in ("token_slots", "permutation", "block_slots", "block_starts", "block_ends"):
            assert getattr(lay, t).data_ptr() % 16 == 0, t
