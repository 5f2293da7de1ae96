"""Kernel inputs found mishandled by the ninth hunt: each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE
from float64_reference import lora_delta_f64, rel_err

from kernels import (
    LoRAWeights,
    SegmentLayout,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    plan_segments,
)
from kernels.expand import launch_shape
from kernels.lora_epilogue import PendingLoRA
from kernels.row_lora import UnshrunkLoRA
from kernels.silu_mul import silu_mul

SLOTS = [0, 2, 1, 1]
"""Rows of slots 0 and 1 and one of the neutral slot (2)."""


@pytest.fixture(autouse=True)
def _fresh_launch_shapes():
    launch_shape.cache_clear()
    yield
    launch_shape.cache_clear()


def _weights(widths=(16, 16), k=24, max_rank=8) -> LoRAWeights:
    g = torch.Generator().manual_seed(0)
    w = LoRAWeights.for_linear(2, k, list(widths), max_rank, torch.float32, DEVICE)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g))
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g))
    w.ranks[:2] = torch.tensor([[8, 1], [3, 0]])[:, : len(widths)]
    w.scalings[:2] = torch.tensor([[0.5, 2.0], [1.5, -1.0]])[:, : len(widths)]
    return w


def _layout(slots=SLOTS, block_m=16) -> SegmentLayout:
    return SegmentLayout.from_plan(plan_segments(slots, block_m=block_m, skip_slot=2), DEVICE)


def _x(k=24) -> torch.Tensor:
    return torch.randn(len(SLOTS), k, generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


@pytest.mark.parametrize("table", ["ranks", "scalings"])
@pytest.mark.parametrize("launcher", ["expand", "one_launch", "silu_mul", "embedding"])
def test_rank_and_scaling_tables_of_another_memory_layout_are_refused(launcher, table):
    """The kernels read entry (slot, slice) at ``slot * slices + slice``; a column-major
    table (``t().contiguous().t()``, of the right shape, dtype and device) passed every check
    and each kernel read other slots' ranks and scalings: a term off by 99% of itself."""
    w, layout, x = _weights(), _layout(), _x()
    if launcher == "embedding":
        w = LoRAWeights.for_embedding(2, 10, 16, 8, torch.float32, DEVICE)
        w.ranks[:2] = torch.tensor([[8], [3]])
        # One slice: a column-major [3, 1] table is still contiguous; a strided one is not.
        setattr(w, table, torch.cat([getattr(w, table)] * 2, 1)[:, :1])
        with pytest.raises(ValueError, match=f"{table} must be contiguous"):
            lora_embedding_shrink(torch.tensor([1, 2, 3, 4], device=DEVICE), w, layout)
        return
    setattr(w, table, _column_major(getattr(w, table)))
    y = torch.zeros(len(SLOTS), 32, device=DEVICE)
    with pytest.raises(ValueError, match=f"{table} must be contiguous.*{table}.contiguous()"):
        if launcher == "expand":
            lora_expand(lora_shrink(x, w, layout), w, y, layout)
        elif launcher == "one_launch":
            lora_shrink_expand(x, w, y, layout)
        else:
            silu_mul(y, UnshrunkLoRA(x, w, layout))
    assert not y.any()
    setattr(w, table, getattr(w, table).contiguous())  # the fix the message names
    lora_shrink_expand(x, w, y, layout)
    assert rel_err(y, lora_delta_f64(x, w, SLOTS)) < 1e-5


@pytest.mark.parametrize("override, says", [
    # Ran with no output group: nothing added, silently.
    (dict(block_n=-16), "block_n must be a power of two >= 1, got -16"),
    # Failed inside the kernel ("arange's range must be a power of 2").
    (dict(block_n=24), "block_n must be a power of two >= 1, got 24"),
    # Ran as 2 tiles a program (python -m bench.sweep labelled the row 3), 0 as the
    # heuristic's.
    (dict(tiles=3), "tiles must be a power of two >= 1, got 3"),
    (dict(tiles=0), "tiles must be a power of two >= 1, got 0"),
    (dict(num_warps=3), "num_warps must be a power of two >= 1, got 3"),
])
def test_expand_overrides_are_taken_as_given_or_refused(override, says):
    w, layout, x = _weights(), _layout(), _x()
    a = lora_shrink(x, w, layout)
    y = torch.zeros(len(SLOTS), 32, device=DEVICE)
    for _ in range(2):  # a launch shape is cached: the refusal must not be
        with pytest.raises(ValueError, match=says):
            lora_expand(a, w, y, layout, **override)
    assert not y.any()
    lora_expand(a, w, y, layout, tiles=4, block_n=16, num_warps=1)
    assert rel_err(y, lora_delta_f64(x, w, SLOTS)) < 1e-5


@pytest.mark.parametrize("override, says", [
    (dict(tiles=5), "tiles must be a power of two >= 1, got 5"),
    (dict(block_k=0), "block_k must be a power of two >= 16, got 0"),  # ran the heuristic
    (dict(block_n=48), "block_n must be a power of two >= 1, got 48"),
])
def test_one_launch_overrides_are_taken_as_given_or_refused(override, says):
    w, layout, x = _weights(), _layout(), _x()
    y = torch.zeros(len(SLOTS), 32, device=DEVICE)
    with pytest.raises(ValueError, match=says):
        lora_shrink_expand(x, w, y, layout, **override)
    assert not y.any()
    lora_shrink_expand(x, w, y, layout, tiles=8, block_n=16)
    assert rel_err(y, lora_delta_f64(x, w, SLOTS)) < 1e-5


@pytest.mark.parametrize("split_k", [0, -2, 2.5, True])
def test_a_split_count_that_is_no_positive_integer_is_refused(split_k):
    """0 and -2 ran unsplit; 2.5 failed inside the kernel ("'float' object cannot be
    interpreted as an integer": a float split length)."""
    w, layout, x = _weights(k=96), _layout(), _x(96)
    with pytest.raises(ValueError, match=f"split_k must be an integer >= 1.*got {split_k!r}"):
        lora_shrink(x, w, layout, split_k=split_k, block_k=16)
    with pytest.raises(ValueError, match="num_warps must be a power of two >= 1, got 6"):
        lora_shrink(x, w, layout, num_warps=6)


def test_sizes_given_as_numpy_integers_are_python_ints():
    """``LoRAWeights.for_linear(max_rank=np.max(ranks))`` was taken, then the first launch
    failed with "'numpy.int64' object has no attribute 'bit_length'"; a numpy block_m with
    "arange's arguments must be of type tl.constexpr"; numpy or torch slice widths with
    "The truth value of an array ... is ambiguous"."""
    w = LoRAWeights.for_linear(np.int64(2), np.int64(24), np.array([16, 16]), np.int64(8),
                               torch.float32, DEVICE)
    assert type(w.max_rank) is int and w.slice_bounds == (0, 16, 32)
    assert all(type(b) is int for b in w.slice_bounds)
    ref = _weights()
    for name in ("lora_a", "lora_b", "ranks", "scalings"):
        getattr(w, name).copy_(getattr(ref, name))
    layout = SegmentLayout.from_plan(plan_segments(SLOTS, block_m=np.int64(16), skip_slot=2),
                                     DEVICE)
    assert type(layout.block_m) is int
    x, y = _x(), torch.zeros(len(SLOTS), 32, device=DEVICE)
    lora_expand(lora_shrink(x, w, layout), w, y, layout)
    assert rel_err(y, lora_delta_f64(x, w, SLOTS)) < 1e-5
    w = LoRAWeights.for_linear(2, 24, torch.tensor([16, 8]), 8, torch.float32, DEVICE)
    assert w.slice_bounds == (0, 16, 24)
    emb = LoRAWeights.for_embedding(2, np.int64(10), 16, np.int64(8), torch.float32, DEVICE)
    assert type(emb.max_rank) is int


@pytest.mark.parametrize("call, says", [
    # torch.zeros named a "Dimension size", not the argument.
    (lambda: LoRAWeights.for_embedding(2, -1, 16, 8, torch.float32, DEVICE),
     "vocab_size must be >= 1, got -1"),
    (lambda: LoRAWeights.for_embedding(2, 0, 16, 8, torch.float32, DEVICE),
     "vocab_size must be >= 1, got 0"),
    # torch.zeros: "argument 'size' failed to unpack the object at pos 2".
    (lambda: LoRAWeights.for_linear(2, 24, [16], 8.0, torch.float32, DEVICE),
     "max_rank must be an integer, got 8.0"),
    (lambda: LoRAWeights.for_linear(2, 24.5, [16], 8, torch.float32, DEVICE),
     "in_features must be an integer, got 24.5"),
    (lambda: LoRAWeights.for_linear(2, 24, [16, 7.5], 8, torch.float32, DEVICE),
     "slice widths must be integers, got"),
    # Planned as block_m 16, the launch's tl.arange then failed in the kernel.
    (lambda: plan_segments([0], block_m=16.0), "block_m must be a positive power of two.*"
     "got 16.0"),
])
def test_sizes_that_are_not_integers_are_named(call, says):
    with pytest.raises((ValueError, TypeError), match=says):
        call()


def test_an_unshrunk_term_on_another_device_is_named_after_good_launches():
    """The unshrunk term's checks are kept per signature, which held ``y``'s device but not
    ``x``'s: after a good launch, ``x`` on another device reached the kernel ("Cannot copy
    out of meta tensor"; on a GPU Triton's "Pointer argument cannot be accessed")."""
    w, layout, x = _weights(), _layout(), _x()
    gate_up = torch.randn(len(SLOTS), 32, device=DEVICE)
    silu_mul(gate_up, UnshrunkLoRA(x, w, layout))
    with pytest.raises(ValueError, match="must be contiguous int32 on meta, got torch.int32 on"):
        silu_mul(gate_up, UnshrunkLoRA(x.to("meta"), w, layout))
    a = lora_shrink(x, w, layout)  # and the pending term, checked in full every time
    with pytest.raises(ValueError, match="a is on meta but y is on"):
        silu_mul(gate_up, PendingLoRA(a.to("meta"), w, layout))
