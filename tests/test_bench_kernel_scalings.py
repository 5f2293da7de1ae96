"""The kernel suite's check must see an expand that applies another slot's or slice's
scaling: with one scaling (2.0) in every slot and slice of its weights, such a kernel
computed exactly the reference and its case was verified and timed."""

from __future__ import annotations

import copy

import pytest
import torch

from bench import kernel_bench
from bench.kernel_bench import KernelCase, VerificationError, make_weights
from kernels import SegmentLayout, lora_expand, plan_segments

CASE = KernelCase("tiny", "qkv_proj", 16, 4, 8, torch.float32)


def _slice0(w):  # every slice scaled by its slot's first slice's scaling
    return w.scalings[:, :1].expand_as(w.scalings).contiguous()


def _slot0(w):  # every slot scaled by slot 0's scalings
    return w.scalings[:1].expand_as(w.scalings).contiguous()


@pytest.mark.parametrize("wrong", [_slice0, _slot0])
def test_an_expand_reading_another_scaling_fails_the_check(monkeypatch, wrong):
    def faulty_expand(a, w, y, layout):
        w2 = copy.copy(w)
        w2.scalings = wrong(w)
        w2.tables_checked = w2.expand_checked = None
        lora_expand(a, w2, y, layout)

    monkeypatch.setattr(kernel_bench, "lora_expand", faulty_expand)
    slots, lens = CASE.token_slots()
    plan = plan_segments(slots, lens, block_m=CASE.block_m)
    layout = SegmentLayout.from_plan(plan, torch.device("cpu"))
    w = make_weights(CASE, "cpu")
    x = torch.randn(CASE.tokens, CASE.shape.in_features)
    with pytest.raises(VerificationError, match="fp32 reference"):
        kernel_bench._check(CASE, w, x, layout, plan.token_slots)


def test_the_correct_expand_passes_with_distinct_scalings():
    slots, lens = CASE.token_slots()
    plan = plan_segments(slots, lens, block_m=CASE.block_m)
    layout = SegmentLayout.from_plan(plan, torch.device("cpu"))
    w = make_weights(CASE, "cpu")
    assert len({float(s) for s in w.scalings[: CASE.adapters].flatten()}) > 1
    errs = kernel_bench._check(CASE, w, torch.randn(CASE.tokens, CASE.shape.in_features),
                               layout, plan.token_slots)
    assert errs["triton"] < 1e-4
