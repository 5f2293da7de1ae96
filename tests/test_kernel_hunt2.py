"""Kernel inputs found mishandled by a later hunt: each test failed before its fix."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kernels import (
    LoRAWeights,
    SegmentLayout,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    plan_segments,
)
from kernels.lora_epilogue import PendingLoRA
from kernels.row_lora import UnshrunkLoRA
from kernels.silu_mul import silu_mul

SLOTS = [0, 1, 2, 0, 1]


def _layout(slots=SLOTS):
    return SegmentLayout.from_plan(plan_segments(slots, block_m=16), DEVICE)


def _term64(x: torch.Tensor, w: LoRAWeights, slots) -> torch.Tensor:
    """float64 ``scaling * (x @ A^T) @ B^T`` per row's slot, ranks read as 0..max_rank."""
    r = w.max_rank
    y = torch.zeros(x.shape[0], w.lora_b.shape[1], dtype=torch.float64)
    for row, slot in enumerate(slots):
        for s in range(w.num_slices if slot < w.num_slots else 0):
            k = min(max(int(w.ranks[slot, s]), 0), r)
            if k:
                lo, hi = w.slice_bounds[s], w.slice_bounds[s + 1]
                a = w.lora_a[slot, s * r : s * r + k].double().cpu() @ x[row].double().cpu()
                y[row, lo:hi] += float(w.scalings[slot, s]) * (w.lora_b[slot, lo:hi, :k]
                                                               .double().cpu() @ a)
    return y


def _odd_ranks() -> LoRAWeights:
    """Slot 0's ranks past max_rank (4) in both slices; slot 1's first slice negative with a
    NaN scaling (rank 0: nothing added, as the torch reference adds nothing)."""
    w = LoRAWeights.for_linear(2, 32, [8, 8], 4, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(0)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g))
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g))
    w.ranks[0] = torch.tensor([6, 40])
    w.ranks[1] = torch.tensor([-3, 4])
    w.scalings[:2] = 0.5
    w.scalings[1, 0] = float("nan")
    return w


def test_ranks_past_max_rank_or_negative_read_and_write_nothing_outside_the_slice():
    """A ranks entry past ``max_rank`` read A rows of the next slice (or past ``lora_a``) and
    wrote ``a`` columns past its slice, past the row at the last slice: rank 40 here ended in
    "double free or corruption". A negative rank with a NaN scaling added NaN (0 * NaN).
    Now a rank is read as 0..max_rank by every kernel, as the torch reference reads it."""
    w, layout = _odd_ranks(), _layout()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = _term64(x, w, SLOTS)
    for split in (1, 2):
        y = torch.zeros(5, 16, device=DEVICE)
        lora_expand(lora_shrink(x, w, layout, split_k=split, block_k=16), w, y, layout)
        assert torch.allclose(y.double().cpu(), want, atol=1e-4), split
    y = torch.zeros(5, 16, device=DEVICE)
    lora_shrink_expand(x, w, y, layout)
    assert torch.allclose(y.double().cpu(), want, atol=1e-4)


@pytest.mark.parametrize("by_rows", [True, False])
@pytest.mark.parametrize("term", ["unshrunk", "pending"])
def test_consumers_read_ranks_as_zero_to_max_rank(term, by_rows, monkeypatch):
    """The by-rows and by-blocks consumers (here SwiGLU's) take the same reading; by rows, a
    rank-0 slice's NaN scaling added NaN too (the expand skips the slice)."""
    from kernels import config

    monkeypatch.setattr(config, "row_epilogue", lambda *a: by_rows)
    monkeypatch.setattr(config, "unshrunk_by_windows", lambda *a: not by_rows)
    w, layout = _odd_ranks(), _layout()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gate_up = torch.randn(5, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with_term = gate_up.double().cpu() + _term64(x, w, SLOTS)
    g, u = with_term[:, :8], with_term[:, 8:]
    want = g * torch.sigmoid(g) * u
    lora = (UnshrunkLoRA(x, w, layout) if term == "unshrunk"
            else PendingLoRA(lora_shrink(x, w, layout), w, layout))
    assert torch.allclose(silu_mul(gate_up, lora).double().cpu(), want, atol=1e-4)


def test_an_embedding_rank_past_max_rank_gathers_max_rank_columns():
    """The gather stored ``rank`` columns into a ``max_rank``-wide row of ``a``: past it,
    over the next rows (here slot 0's, gathered before) and past ``a``'s end."""
    w = LoRAWeights.for_embedding(2, 10, 8, 4, torch.float32, DEVICE)
    w.lora_a.normal_()
    w.ranks[:2] = torch.tensor([[4], [9]])
    a = lora_embedding_shrink(torch.tensor([1, 2, 3], device=DEVICE), w, _layout([1, 0, 0]))
    want = torch.stack([w.lora_a[1, 1], w.lora_a[0, 2], w.lora_a[0, 3]]).float()
    assert torch.equal(a, want)


def test_inputs_without_columns_are_named():
    """``in_features`` 0 was taken, then the shrink's K split divided by zero
    (``ZeroDivisionError: integer division or modulo by zero``)."""
    with pytest.raises(ValueError, match="in_features must be >= 1, got 0"):
        LoRAWeights.for_linear(2, 0, [8], 4, torch.float32, DEVICE)
    w = LoRAWeights.for_linear(2, 4, [8], 4, torch.float32, DEVICE)
    w.lora_a = w.lora_a[:, :, :0]
    x, y = torch.zeros(5, 0, device=DEVICE), torch.zeros(5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x has no columns"):
        lora_shrink(x, w, _layout())
    with pytest.raises(ValueError, match="x has no columns"):
        lora_shrink_expand(x, w, y, _layout())


def test_a_static_layout_of_negative_rows_is_named():
    from kernels import StaticSegmentLayout

    with pytest.raises(ValueError, match="max_rows must be >= 0.*-1"):
        StaticSegmentLayout(-1, 3, 16, neutral_slot=2, device=DEVICE)
    assert StaticSegmentLayout(0, 3, 16, neutral_slot=2, device=DEVICE).view(0).num_rows == 0
