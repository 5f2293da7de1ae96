"""The base GEMM with its LoRA term in one launch (``kernels/lora_gemm.py``), against float64:
random layouts (decode and prefill rows, the neutral slot, rank-0 slices, padding rows of a
static view, empty blocks), unequal slices, launch shapes that leave tickets over for the
epilogue's leftover loop; the counters it leaves zero; errors that name the bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from float64_reference import TOL, lora_delta_f64, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import linear_cases

from kernels import LoRAWeights, SegmentLayout, config, plan_segments
from kernels.lora_gemm import lora_gemm

EXAMPLES = 40 if ON_GPU else 10


def _base_weight(w: LoRAWeights, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, k = w.lora_b.shape[1], w.lora_a.shape[2]
    return (torch.randn(n, k, generator=g) * k**-0.5).to(w.lora_a.dtype).to(DEVICE)


def _expected(x, weight, case) -> torch.Tensor:
    return x.double().cpu() @ weight.double().cpu().T + lora_delta_f64(x, case.weights,
                                                                       case.token_slots)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_lora_gemm_matches_float64(dtype, data):
    case = data.draw(linear_cases(dtype, DEVICE))
    rows = len(case.token_slots)
    k = case.weights.lora_a.shape[2]
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))).to(dtype)
    x = x.to(DEVICE)
    weight = _base_weight(case.weights, k)
    block_n = data.draw(st.sampled_from([None, 16, 32]))
    block_k = data.draw(st.sampled_from([None, 16, 32]))
    y = lora_gemm(x, weight, case.weights, case.layout, block_n=block_n, block_k=block_k)
    assert y.shape == (rows, weight.shape[0])
    assert rel_err(y, _expected(x, weight, case)) <= TOL[dtype]
    assert case.weights.sync.tolist() == [0, 0, 0], "the last program must reset the counters"


def test_rows_without_adapter_get_the_base_output_only():
    """Neutral rows beside LoRA rows: their output is the plain GEMM (no other slot's B)."""
    dtype = torch.float32
    w = LoRAWeights.for_linear(3, 48, [24, 8], 8, dtype, DEVICE)
    g = torch.Generator().manual_seed(1)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g))
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g))
    w.ranks[:3].fill_(8)
    w.scalings[:3].fill_(2.0)
    slots = [0, 3, 2, 3, 0, 1]
    layout = SegmentLayout.from_plan(plan_segments(slots, block_m=16, skip_slot=3), DEVICE)
    x = torch.randn(len(slots), 48, generator=g).to(DEVICE)
    weight = torch.randn(32, 48, generator=g).to(DEVICE)
    y = lora_gemm(x, weight, w, layout, block_n=16, block_k=16).cpu()
    plain = (x @ weight.T).cpu()
    for row in (1, 3):
        torch.testing.assert_close(y[row], plain[row], rtol=1e-5, atol=1e-5)
    assert rel_err(y, x.double().cpu() @ weight.double().cpu().T
                   + lora_delta_f64(x, w, slots)) <= TOL[dtype]


def test_bad_inputs_are_refused_by_name():
    w = LoRAWeights.for_linear(2, 32, [16], 4, torch.float32, DEVICE)
    layout = SegmentLayout.from_plan(plan_segments([0, 1], block_m=16, skip_slot=2), DEVICE)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be \\[out, 32\\]"):
        lora_gemm(x, torch.randn(16, 24, device=DEVICE), w, layout)
    with pytest.raises(ValueError, match="lora_b must be \\[slots, 8, 4\\]"):
        lora_gemm(x, torch.randn(8, 32, device=DEVICE), w, layout)
    many = config.LORA_GEMM_MAX_ROWS + 1
    big = SegmentLayout.from_plan(plan_segments([0] * many, block_m=16, skip_slot=2), DEVICE)
    with pytest.raises(ValueError, match="separate LoRA path"):
        lora_gemm(torch.randn(many, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE), w,
                  big)
    assert w.sync is None or w.sync.tolist() == [0, 0, 0]


def test_a_batch_without_adapter_rows_is_the_plain_gemm():
    """Every row on the neutral slot: the layout has no blocks, so no ticket exists."""
    w = LoRAWeights.for_linear(2, 32, [16], 4, torch.float32, DEVICE)
    w.lora_b.fill_(1.0)
    w.ranks[:2].fill_(4)
    layout = SegmentLayout.from_plan(plan_segments([2, 2, 2], block_m=16, skip_slot=2), DEVICE)
    assert layout.block_slots.shape[0] == 0
    x, weight = torch.randn(3, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    torch.testing.assert_close(lora_gemm(x, weight, w, layout, block_n=16, block_k=16),
                               x @ weight.T, rtol=1e-5, atol=1e-5)
    assert w.sync.tolist() == [0, 0, 0]
