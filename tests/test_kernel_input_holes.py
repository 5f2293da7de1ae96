"""Inputs the LoRA launchers once took silently and then read or wrote out of bounds, raced on
or computed wrongly with: each is refused with a message naming the input and the fix, or
(where refusing needs a device sync) made harmless inside the kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU

from kernels import (
    LoRAWeights,
    SegmentLayout,
    StaticSegmentLayout,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    plan_segments,
)
from kernels.reference import expand_reference, shrink_reference
from kernels.row_lora import UnshrunkLoRA


def _linear(widths=(8, 4), k=32, slots=2, dtype=torch.float32):
    w = LoRAWeights.for_linear(slots, k, list(widths), 4, dtype, DEVICE)
    w.lora_a.normal_()
    w.lora_b.normal_()
    w.ranks[:slots] = 4
    w.scalings[:slots] = 0.5
    return w


def _layout(slots, block_m=16):
    return SegmentLayout.from_plan(plan_segments(slots, block_m=block_m), DEVICE)


def _embedding(vocab=10):
    w = LoRAWeights.for_embedding(2, vocab, 8, 4, torch.float32, DEVICE)
    w.lora_a.normal_()
    w.lora_b.normal_()
    w.ranks[:2] = 4
    w.scalings[:2] = 1.0
    return w


# -- token ids outside the vocabulary -----------------------------------------------------------

@pytest.mark.parametrize("bad", [10, -1])
def test_embedding_ids_outside_the_vocabulary_are_named_on_cpu(bad):
    """An id past the vocabulary read another slot's rows or memory past ``lora_a`` (garbage
    such as 1e35, or a segfault for 10**9). On CPU tensors the launcher refuses it (the check
    costs no device sync there); the engine refuses such prompts before they get here."""
    w, layout = _embedding(), _layout([0, 1, 0])
    ids = torch.tensor([1, bad, 3], device=DEVICE)
    if ON_GPU:  # no eager check there (a sync): the row reads nothing and contributes zero
        a = lora_embedding_shrink(ids, w, layout)
        assert torch.equal(a[1], torch.zeros_like(a[1]))
        return
    with pytest.raises(ValueError, match=r"token_ids .*outside the vocabulary 0\.\.9"):
        lora_embedding_shrink(ids, w, layout)


def test_the_gather_kernel_reads_nothing_for_ids_outside_the_vocabulary():
    """Where the launcher cannot look at the ids (a GPU, a captured graph) the kernel masks
    them: the row's ``a`` is zero, so it adds nothing, and no memory past ``lora_a`` is read
    (10**9 rows past it segfaulted the interpreter)."""
    from kernels.embedding import _gather

    w, layout = _embedding(), _layout([0, 1, 0, 1])
    ids = torch.tensor([1, 10, -1, 10**9], device=DEVICE)
    a = _gather(ids, w.lora_a, w.ranks, layout.permutation, layout.block_slots,
                layout.block_starts, layout.block_ends, layout.block_m)
    assert torch.equal(a[0], w.lora_a[0, 1].float())
    assert torch.equal(a[1:], torch.zeros_like(a[1:]))


def test_embedding_ids_inside_the_vocabulary_still_gather():
    w, layout = _embedding(), _layout([0, 1, 0])
    ids = torch.tensor([0, 9, 3], device=DEVICE)
    a = lora_embedding_shrink(ids, w, layout)
    assert torch.equal(a, torch.stack([w.lora_a[0, 0], w.lora_a[1, 9], w.lora_a[0, 3]]).float())


# -- an output whose rows overlap ---------------------------------------------------------------

def _overlapping_ys():
    row = torch.zeros(1, 12, device=DEVICE)
    buf = torch.zeros(64, device=DEVICE)
    return {
        "expand()-ed": row.expand(5, 12),
        "row stride below the width": buf.as_strided((5, 12), (4, 1)),
        "stride-0 columns": buf.as_strided((5, 12), (12, 0)),
    }


@pytest.mark.parametrize("kind", list(_overlapping_ys()))
def test_an_output_with_overlapping_rows_is_refused(kind):
    """Programs of different blocks read-modify-write ``y``'s rows: rows sharing memory race
    (on a GPU, lost updates; under the interpreter the last row's sum wins)."""
    w, layout = _linear(), _layout([0, 1, 2, 0, 1])
    x = torch.randn(5, 32, device=DEVICE)
    a = lora_shrink(x, w, layout)
    y = _overlapping_ys()[kind]
    with pytest.raises(ValueError, match=r"y .*overlap.*contiguous"):
        lora_expand(a, w, y, layout)
    with pytest.raises(ValueError, match=r"y .*overlap.*contiguous"):
        lora_shrink_expand(x, w, y, layout)


def test_a_row_stride_below_the_width_is_fine_for_one_row_only():
    """A one-row ``y`` with a row stride below its width is fine (one row cannot overlap
    another); the same strides over five rows are not, after a launch on the one row."""
    w = _linear()
    x1, x5 = torch.randn(1, 32, device=DEVICE), torch.randn(5, 32, device=DEVICE)
    buf = torch.zeros(64, device=DEVICE)
    one = buf.as_strided((1, 12), (4, 1))
    lora_shrink_expand(x1, w, one, _layout([0]))
    lora_expand(lora_shrink(x1, w, _layout([0])), w, one, _layout([0]))
    with pytest.raises(ValueError, match=r"y .*overlap"):
        lora_shrink_expand(x5, w, buf.as_strided((5, 12), (4, 1)), _layout([0, 1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"y .*overlap"):
        lora_expand(lora_shrink(x5, w, _layout([0, 1, 0, 1, 0])), w,
                    buf.as_strided((5, 12), (4, 1)), _layout([0, 1, 0, 1, 0]))


def test_outputs_with_disjoint_rows_are_still_taken():
    """Not refused: a column slice of a wider buffer (the delta of ``lora_shrink_with_delta``)
    and a transposed ``y`` (rows disjoint, columns strided)."""
    w, layout = _linear(), _layout([0, 1, 2, 0, 1])
    x = torch.randn(5, 32, device=DEVICE)
    want = torch.zeros(5, 12, device=DEVICE)
    expand_reference(shrink_reference(x, w, layout), w, want, layout)
    a = lora_shrink(x, w, layout)
    wide = torch.zeros(5, 20, device=DEVICE)
    lora_expand(a, w, wide[:, 8:], layout)
    transposed = torch.zeros(12, 5, device=DEVICE).t()
    lora_expand(a, w, transposed, layout)
    for y in (wide[:, 8:], transposed):
        assert torch.allclose(y, want, atol=1e-4)


# -- the one-launch kernel writing into its own input -------------------------------------------

def test_one_launch_refuses_an_output_that_shares_memory_with_x():
    """The one-launch kernel recomputes ``x @ A^T`` in every output group's program: a ``y``
    in ``x``'s memory is read after other programs added to it (max error 386 here). The two
    launches (``lora_expand(lora_shrink(x), w, x)``) stay the way to add in place."""
    w, layout = _linear(widths=(32,)), _layout([0, 1, 2, 0, 1])
    x = torch.randn(5, 32, device=DEVICE)
    want = x.clone()
    lora_expand(lora_shrink(want, w, layout), w, want, layout)
    msg = r"y shares memory with x.*lora_expand\(lora_shrink"
    with pytest.raises(ValueError, match=msg):
        lora_shrink_expand(x, w, x, layout, None, None, 16)
    both = torch.cat([x, x], 1)
    with pytest.raises(ValueError, match=msg):  # overlapping column slices of one buffer
        lora_shrink_expand(both[:, :32], w, both[:, 16:48], layout)
    flat = torch.zeros(6 * 64, device=DEVICE)
    with pytest.raises(ValueError, match=msg):  # y's rows run into x's next ones
        lora_shrink_expand(flat[64:].view(5, 64)[:, :32], w,
                           flat[40 : 40 + 5 * 64].view(5, 64)[:, :32], layout)
    lora_shrink_expand(both[:, :32], w, both[:, 32:], layout)  # disjoint slices: taken
    assert torch.allclose(both[:, 32:], want, atol=1e-4)
    assert torch.equal(both[:, :32], x)
    same = x.clone()
    lora_expand(lora_shrink(same, w, layout), w, same, layout)
    assert torch.allclose(same, want, atol=1e-5)


def test_shares_memory_is_exact_for_column_slices_of_one_buffer():
    from kernels.shrink_expand import shares_memory

    buf = torch.zeros(4, 64, device=DEVICE)
    assert shares_memory(buf[:, :32], buf[:, :32])
    assert shares_memory(buf[:, :32], buf[:, 31:63])
    assert not shares_memory(buf[:, :32], buf[:, 32:])
    assert not shares_memory(buf[:, 32:], buf[:, :32])
    assert not shares_memory(buf[1:, :32], buf[:-1, 32:])  # y's rows end where x's start
    flat = buf.view(-1)
    assert shares_memory(flat[64:].view(3, 64)[:, :32], flat[40:232].view(3, 64)[:, :32])
    assert not shares_memory(flat[64:].view(3, 64)[:, :32], flat[32:224].view(3, 64)[:, :32])
    assert not shares_memory(buf[:1, :32], buf[1:2, :32])
    assert not shares_memory(buf[:, :32], torch.zeros(4, 32, device=DEVICE))
    assert shares_memory(buf[:, :32], buf.t()[:4])  # other strides whose ranges meet


def test_shares_memory_agrees_with_the_addresses_of_column_slices():
    """Against the element addresses: x and y column windows of one buffer, at every row
    offset and column start, of one, two and four rows, fp32 x with fp32 or fp16 y."""
    from kernels.shrink_expand import shares_memory

    def addresses(t):
        r, c = torch.meshgrid(torch.arange(t.shape[0]), torch.arange(t.shape[1]), indexing="ij")
        first = t.data_ptr() + (r * t.stride(0) + c * t.stride(1)) * t.element_size()
        return {(int(a) + b) for a in first.flatten() for b in range(t.element_size())}

    buf, seen = torch.zeros(6 * 16, device="cpu"), set()
    for rows in (1, 2, 4):
        x = buf[16 : 16 + rows * 16].view(rows, 16)[:, 2:9]
        for start in range(0, 16 * 2 + 14):
            for dtype in (torch.float32, torch.float16):
                flat = buf.view(dtype)
                scale = 4 // flat.element_size()
                row = 16 * scale
                if start * scale + (rows - 1) * row + 5 * scale > flat.numel():
                    continue
                y = flat[start * scale:].as_strided((rows, 5 * scale), (row, 1))
                meet = bool(addresses(x) & addresses(y))
                assert shares_memory(x, y) == meet, (rows, start, dtype)
                seen.add(meet)
    assert seen == {True, False}


# -- `a` on another device ------------------------------------------------------------------------

def test_a_on_another_device_than_y_is_named():
    """``a``'s shape and dtype were checked, its device not: a CPU ``a`` for a GPU ``y``
    failed inside Triton without naming it (here: a meta ``a``)."""
    w, layout = _linear(), _layout([0, 1, 2, 0, 1])
    a = torch.zeros(5, 8, device="meta")
    with pytest.raises(ValueError, match=r"a is on meta but y is on"):
        lora_expand(a, w, torch.zeros(5, 12, device=DEVICE), layout)


def test_lora_b_with_fewer_slots_than_lora_a_is_named():
    """B's rank and width were checked, its slot count not: slot 1 of a one-slot B was read
    past its end."""
    w, layout = _linear(), _layout([0, 1, 2])
    x = torch.randn(3, 32, device=DEVICE)
    a = lora_shrink(x, w, layout)
    w.lora_b = w.lora_b[:1].contiguous()
    with pytest.raises(ValueError, match=r"lora_b must be \[slots=2, out, max_rank=4\]"):
        lora_expand(a, w, torch.zeros(3, 12, device=DEVICE), layout)
    with pytest.raises(ValueError, match=r"lora_b must be \[slots=2"):
        lora_shrink_expand(x, w, torch.zeros(3, 12, device=DEVICE), layout)


# -- slots outside the pool -----------------------------------------------------------------------

def test_negative_slots_are_refused_when_planned():
    with pytest.raises(ValueError, match=r"slot -1 .*slots are 0"):
        plan_segments([0, -1, 1], block_m=16)
    with pytest.raises(ValueError, match=r"slot -2 .*slots are 0"):
        plan_segments([0, -2], [3, 1], block_m=16)


@pytest.mark.parametrize("slot", [3, 7])
def test_layouts_naming_slots_past_the_weights_are_refused(slot):
    """Slot 3 of a 2-slot pool read ranks, scalings, A and B past their ends (slot 2 is the
    neutral one): a layout from another pool, or request slots not from this one."""
    w, x = _linear(), torch.randn(3, 32, device=DEVICE)
    layout = _layout([0, slot, 1])
    msg = rf"layout names slot {slot} but the weights have slots 0\.\.1 and the neutral slot 2"
    with pytest.raises(ValueError, match=msg):
        lora_shrink(x, w, layout)
    good = lora_shrink(x, w, _layout([0, 1, 1]))
    with pytest.raises(ValueError, match=msg):
        lora_expand(good, w, torch.zeros(3, 12, device=DEVICE), layout)
    with pytest.raises(ValueError, match=msg):
        lora_shrink_expand(x, w, torch.zeros(3, 12, device=DEVICE), layout)
    with pytest.raises(ValueError, match=msg):
        lora_embedding_shrink(torch.tensor([1, 2, 3], device=DEVICE), _embedding(), layout)


def test_a_layout_checked_for_a_larger_pool_is_checked_again_for_a_smaller_one():
    """A layout's tensors are checked once per device; its slots against each pool, every
    launch (the one-launch and the consumer paths' cached signatures included)."""
    big, small = _linear(slots=4), _linear(slots=2)
    x, y = torch.randn(3, 32, device=DEVICE), torch.zeros(3, 12, device=DEVICE)
    good, bad = _layout([0, 1, 2]), _layout([0, 3, 1])
    UnshrunkLoRA(x, small, good).check(y, "test")  # the consumer's signature is now cached
    lora_shrink_expand(x, small, y, good)
    lora_shrink_expand(x, big, y, bad)  # fine for 4 slots: the layout counts as checked
    with pytest.raises(ValueError, match="layout names slot 3"):
        UnshrunkLoRA(x, small, bad).check(y, "test")
    with pytest.raises(ValueError, match="layout names slot 3"):
        lora_shrink_expand(x, small, y, bad)


def test_static_layouts_refuse_slots_past_their_neutral_slot():
    """A static layout may count more slots than its pool (``num_slots`` bounds its blocks);
    its rows may name the pool's slots and its neutral slot, the last row of the tables."""
    static = StaticSegmentLayout(4, 3, 16, neutral_slot=2, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot 3 .*0\.\.2"):
        static.write(plan_segments([0, 3], block_m=16), 4)
    wide = StaticSegmentLayout(4, 6, 16, neutral_slot=2, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot 3 .*0\.\.2"):
        wide.write(plan_segments([0, 3], block_m=16), 4)
    wide.write(plan_segments([0, 2, 1], block_m=16, skip_slot=2), 4)
    lora_shrink(torch.randn(4, 32, device=DEVICE), _linear(slots=2), wide.view(4))
    with pytest.raises(ValueError, match="neutral_slot"):
        StaticSegmentLayout(4, 3, 16, neutral_slot=3, device=DEVICE)
    static.write(plan_segments([0, 2], block_m=16, skip_slot=2), 4)
    w = _linear(slots=1)  # neutral slot 1: the view's slot 2 is past it
    with pytest.raises(ValueError, match="layout names slot 2"):
        lora_shrink(torch.randn(4, 32, device=DEVICE), w, static.view(4))
    lora_shrink(torch.randn(4, 32, device=DEVICE), _linear(slots=2), static.view(4))


# -- fp16: the shrink's output is float32 ---------------------------------------------------------

def test_the_shrink_output_is_float32_past_the_fp16_range():
    """``a`` is accumulated and stored in float32 on every path (shrink, split-K, embedding
    gather): a value past fp16's 65504 stays finite. (The expand rounds ``a`` to the weights'
    dtype before its tensor-core dot, as PEFT computes ``lora_A(x)`` in that dtype.)"""
    w, layout = _linear(dtype=torch.float16), _layout([0, 1, 0])
    w.lora_a.fill_(1.0)
    x = torch.full((3, 32), 4096.0, dtype=torch.float16, device=DEVICE)  # sums to 131072
    for split in (1, 2):
        a = lora_shrink(x, w, layout, split_k=split, block_k=16)
        assert a.dtype == torch.float32
        assert torch.equal(a[:, :4], torch.full_like(a[:, :4], 131072.0))


def test_static_layouts_refuse_a_plan_of_another_block_size_or_negative_slots():
    """Blocks of 64 rows written where kernels span 16 would leave 48 rows of each block
    without their LoRA term, silently; a plan built by hand may name a negative slot. Both
    are refused with the buffer as it was."""
    import dataclasses

    static = StaticSegmentLayout(8, 3, 16, neutral_slot=2, device=DEVICE)
    static.write(plan_segments([0, 1, 1], block_m=16, skip_slot=2), 4)
    before = static._buf.clone()
    with pytest.raises(ValueError, match="block_m=64, layout needs 16"):
        static.write(plan_segments([1, 0], block_m=64, skip_slot=2), 4)
    hand = dataclasses.replace(plan_segments([0, 1], block_m=16), seg_slots=[-1, 1])
    with pytest.raises(ValueError, match="names slot -1"):
        static.write(hand, 4)
    with pytest.raises(ValueError, match=r"rows=9 is outside this layout's capacity 0\.\.8"):
        static.write(None, 9)
    assert torch.equal(static._buf, before)
