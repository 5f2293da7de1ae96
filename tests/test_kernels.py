"""Kernels against a float64 reference: random shapes, segmentations, heterogeneous ranks,
rank-0 slots, empty blocks, permuted rows, padding rows and zero-row batches."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES
from float64_reference import TOL, UNIT_ROUNDOFF, assert_added, lora_delta_f64
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_cases import defined_mask, embedding_cases, linear_cases, plan_is_valid

from kernels import (
    LoRAWeights,
    SegmentLayout,
    config,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    lora_shrink_with_delta,
    plan_segments,
)
from kernels.reference import embedding_shrink_reference, expand_reference, shrink_reference

PROVIDERS = {
    "triton": (
        lambda x, c: lora_shrink(x, c.weights, c.layout, c.split_k, c.block_k),
        lambda a, c, y: lora_expand(a, c.weights, y, c.layout, c.tiles),
    ),
    "torch": (
        lambda x, c: shrink_reference(x, c.weights, c.layout),
        lambda a, c, y: expand_reference(a, c.weights, y, c.layout),
    ),
}


def _input(rows: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@given(data=st.data())
def test_shrink_then_expand_matches_float64(provider, dtype, data):
    case = data.draw(linear_cases(dtype, DEVICE))
    shrink, expand = PROVIDERS[provider]
    rows, k = len(case.token_slots), case.weights.lora_a.shape[2]
    x = _input(rows, k, dtype, data.draw(st.integers(0, 2**31)))
    a = shrink(x, case)
    defined = defined_mask(case).to(DEVICE)
    a_ref = torch.zeros_like(a, dtype=torch.float64)
    a_mag = torch.zeros_like(a_ref)  # |A| |x|: the scale of a dot product's rounding error
    for t, slot in enumerate(case.token_slots):
        if slot < case.weights.num_slots:
            a_ref[t] = case.weights.lora_a[slot].double() @ x[t].double()
            a_mag[t] = case.weights.lora_a[slot].double().abs() @ x[t].double().abs()
    err = (a[defined].double() - a_ref[defined]).norm().item()
    assert err <= TOL[dtype] * a_mag[defined].norm().item() + 1e-300, "shrink output"

    y0 = _input(rows, case.weights.lora_b.shape[1], dtype, 7)
    y = y0.clone()
    expand(a, case, y)
    ref = lora_delta_f64(x, case.weights, case.token_slots)
    assert_added(y, y0, ref, dtype, lora_delta_f64(x, case.weights, case.token_slots,
                                                   magnitude=True))
    untouched = (ref == 0).to(DEVICE)
    assert torch.equal(y[untouched], y0[untouched]), "rows/columns without LoRA must not change"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@given(data=st.data())
def test_joint_shrink_matches_float64_and_leaves_undefined_columns_alone(dtype, data):
    """One program a block for every slice (``config.joint_shrink``): each slice's columns
    masked by that slice's own rank, a block of rank-0 slices only writing nothing."""
    case = data.draw(linear_cases(dtype, DEVICE))
    rows, k = len(case.token_slots), case.weights.lora_a.shape[2]
    x = _input(rows, k, dtype, data.draw(st.integers(0, 2**31)))
    with mock.patch.object(config, "joint_shrink", lambda *shape: True):
        joint = lora_shrink(x, case.weights, case.layout, case.split_k, case.block_k)
        zeroed, _ = lora_shrink_with_delta(x, case.weights, case.layout)  # output starts zeroed
    defined = defined_mask(case).to(DEVICE)
    ref = torch.zeros(joint.shape, dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for t, slot in enumerate(case.token_slots):
        if slot < case.weights.num_slots:
            ref[t] = case.weights.lora_a[slot].double().cpu() @ x[t].double().cpu()
            mag[t] = case.weights.lora_a[slot].double().abs().cpu() @ x[t].double().abs().cpu()
    err = (joint[defined].double().cpu() - ref[defined.cpu()]).norm().item()
    assert err <= TOL[dtype] * mag[defined.cpu()].norm().item() + 1e-300, "joint shrink output"
    assert torch.allclose(zeroed[defined], joint[defined], rtol=1e-2, atol=1e-3)
    assert not zeroed[~defined].any(), "a joint program wrote past a slice's rank"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@given(data=st.data())
def test_one_launch_matches_float64_and_the_two_launches(dtype, data):
    case = data.draw(linear_cases(dtype, DEVICE))
    rows, k = len(case.token_slots), case.weights.lora_a.shape[2]
    x = _input(rows, k, dtype, data.draw(st.integers(0, 2**31)))
    y0 = _input(rows, case.weights.lora_b.shape[1], dtype, 7)
    y = y0.clone()
    lora_shrink_expand(x, case.weights, y, case.layout, case.block_k, case.tiles)
    ref = lora_delta_f64(x, case.weights, case.token_slots)
    magnitude = lora_delta_f64(x, case.weights, case.token_slots, magnitude=True)
    assert_added(y, y0, ref, dtype, magnitude)
    untouched = (ref == 0).to(DEVICE)
    assert torch.equal(y[untouched], y0[untouched]), "rows/columns without LoRA must not change"
    two = y0.clone()
    lora_expand(lora_shrink(x, case.weights, case.layout), case.weights, two, case.layout)
    # Each is within its bound of the float64 sum; so they are within twice it of each other
    # (two summation orders of a term that cancels differ by more than TOL of the term).
    err = (y.double() - two.double()).norm().item()
    allowed = 2 * (TOL[dtype] * magnitude.norm().item()
                   + 2 * UNIT_ROUNDOFF[dtype] * y.double().norm().item())
    assert err <= allowed + 1e-300, f"one launch differs from shrink + expand: {err:.3e}"


def test_the_one_launch_k_step_widens_only_for_one_wave_within_shared_memory(monkeypatch):

    monkeypatch.setattr(config, "programs_wanted", lambda device: 4 * 132)
    cuda = torch.device("cuda")
    for block_r in (16, 32, 64, 128):
        for block_m in (16, 64):
            for k in (16, 100, 4096, 14336):
                for elt in (2, 4):
                    base = config.shrink_k_block(block_r, k)
                    wide = config.one_launch_k_block(block_r, block_m, k, elt, 132, cuda)
                    assert config.one_launch_k_block(block_r, block_m, k, elt, 133, cuda) == base
                    assert base <= wide <= max(base, min(1024, config.next_pow2(k)))
                    assert wide == base or (block_m + block_r) * wide * elt <= 65536
    assert config.one_launch_k_block(16, 16, 14336, 2, 32, cuda) == 1024  # down at T=1


@pytest.mark.gpu
@pytest.mark.parametrize("k,widths", [(14336, (4096,)), (4096, (4096, 1024, 1024))],
                         ids=["down", "qkv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_launch_with_its_widest_k_step_matches_float64(k, widths, dtype):
    """Llama-3-8B shapes at one and four rows: the grid fits one wave, so the shrink's K step
    widens to what shared memory holds (1024 columns in bf16, 512 in fp32)."""
    g = torch.Generator().manual_seed(5)
    w = LoRAWeights.for_linear(2, k, widths, 16, dtype, DEVICE)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * k**-0.5)
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g) * 0.25)
    w.ranks[:2] = torch.tensor([[16] * len(widths), [5] * len(widths)], dtype=w.ranks.dtype)
    w.scalings[:2] = 1.5
    for slots in ([1], [0, 1, 1, 0]):
        layout = SegmentLayout.from_plan(plan_segments(slots, block_m=16), DEVICE)
        x = _input(len(slots), k, dtype, 11)
        y0 = _input(len(slots), sum(widths), dtype, 12)
        y = y0.clone()
        lora_shrink_expand(x, w, y, layout)
        assert_added(y, y0, lora_delta_f64(x, w, slots), dtype,
                     lora_delta_f64(x, w, slots, magnitude=True))


def test_a_term_that_cancels_is_judged_by_its_magnitude():
    """``A @ x`` at ~1e-3 of ``|A| |x|`` (a draw CI met: rank 1, one row, K=86): two summation
    orders (one launch with block_k=32, and shrink + expand) differ by up to ~1e-4 of the
    term itself, which fp32 cannot resolve; against the term's magnitude both are exact."""
    g = torch.Generator().manual_seed(3)
    k = 86
    w = LoRAWeights.for_linear(1, k, [1], 1, torch.float32, DEVICE)
    x = torch.randn(1, k, generator=g)
    v = torch.randn(k, generator=g) / k**0.5
    a = v - (v @ x[0]) / (x[0] @ x[0]) * x[0] * (1 - 1e-3)
    w.lora_a.copy_(a.view(1, 1, k))
    w.lora_b.fill_(-1.7)
    w.ranks[:1], w.scalings[:1] = 1, 0.62
    plan = plan_segments([0], None, block_m=16, skip_slot=1)
    layout = SegmentLayout.from_plan(plan, DEVICE)
    x, y0 = x.to(DEVICE), torch.full((1, 1), -0.15, device=DEVICE)
    ref = lora_delta_f64(x, w, plan.token_slots)
    magnitude = lora_delta_f64(x, w, plan.token_slots, magnitude=True)
    assert magnitude.norm() > 100 * ref.norm()  # the term cancels
    y, two = y0.clone(), y0.clone()
    lora_shrink_expand(x, w, y, layout, 32)
    lora_expand(lora_shrink(x, w, layout), w, two, layout)
    for out in (y, two):
        assert_added(out, y0, ref, torch.float32, magnitude)


@settings(max_examples=3)
@given(data=st.data())
def test_one_launch_refuses_bad_inputs_and_leaves_y_unchanged(data):
    case = data.draw(linear_cases(torch.float32, DEVICE))
    rows, k = len(case.token_slots), case.weights.lora_a.shape[2]
    assume(rows > 0 and k > 1)
    x = _input(rows, k, torch.float32, 1)
    y = _input(rows, case.weights.lora_b.shape[1], torch.float32, 2)
    before = y.clone()
    bad = {"x must be 2-D": (x[:, ::2], y), "x dtype": (x.half(), y),
           "the prepared LoRA metadata covers": (x, y[1:]),
           "y must be": (x, y[:, 1:]), "block_k must be": (x, y)}
    for msg, (xi, yi) in bad.items():
        with pytest.raises(ValueError, match=msg):
            lora_shrink_expand(xi, case.weights, yi, case.layout,
                               block_k=24 if msg.startswith("block_k") else None)
    assert torch.equal(y, before)


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@given(data=st.data())
def test_embedding_gather_then_expand_matches_float64(provider, dtype, data):
    case = data.draw(embedding_cases(dtype, DEVICE))
    rows, vocab = len(case.token_slots), case.weights.lora_a.shape[1]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ids = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    y0 = _input(rows, case.weights.lora_b.shape[1], dtype, 3)
    y = y0.clone()
    if provider == "triton":
        a = lora_embedding_shrink(ids, case.weights, case.layout)
        lora_expand(a, case.weights, y, case.layout, case.tiles)
    else:
        a = embedding_shrink_reference(ids, case.weights, case.layout)
        expand_reference(a, case.weights, y, case.layout)
    ref = lora_delta_f64(None, case.weights, case.token_slots, token_ids=ids.cpu())
    assert_added(y, y0, ref, dtype, lora_delta_f64(None, case.weights, case.token_slots,
                                                   token_ids=ids.cpu(), magnitude=True))
    untouched = (ref == 0).to(DEVICE)
    assert torch.equal(y[untouched], y0[untouched])


@given(
    slots=st.lists(st.integers(0, 5), max_size=30),
    lens=st.data(),
    block_m=st.sampled_from([1, 2, 16]),
)
def test_plan_groups_rows_by_slot(slots, lens, block_m):
    ls = lens.draw(st.lists(st.integers(0, 7), min_size=len(slots), max_size=len(slots)))
    plan = plan_segments(slots, ls, block_m=block_m, skip_slot=5)
    plan_is_valid(plan)
    covered = sorted(plan.permutation[p] for _, lo, hi in plan.blocks for p in range(lo, hi))
    assert covered == [t for t, s in enumerate(plan.token_slots) if s != 5]
    assert len(plan.seg_slots) == len(set(plan.seg_slots)), "one segment per slot"
