"""Random LoRA kernel problems (hypothesis strategies) shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from kernels import LoRAWeights, SegmentLayout, SegmentPlan, StaticSegmentLayout, plan_segments


@dataclass
class Case:
    weights: LoRAWeights
    layout: SegmentLayout
    token_slots: list[int]  # per row of x, padding rows included (neutral slot)
    split_k: int | None
    block_k: int | None = None
    tiles: int | None = None


def _fill(weights: LoRAWeights, draw_ranks, gen: torch.Generator) -> None:
    w = weights
    k = w.lora_a.shape[2]
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=gen) / max(1, k) ** 0.5)
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=gen) / w.max_rank**0.5)
    w.ranks[: w.num_slots].copy_(torch.tensor(draw_ranks, dtype=torch.int32))
    w.scalings[: w.num_slots].copy_(torch.rand(w.num_slots, w.num_slices, generator=gen) + 0.25)


@st.composite
def layouts(draw, num_slots: int, device, block_ms=(16, 32, 64)):
    """(layout, token_slots): decode- or prefill-shaped requests over slots 0..num_slots
    (num_slots is the neutral slot), sometimes with empty blocks, sometimes in static buffers
    with neutral padding rows."""
    neutral = num_slots
    n_req = draw(st.integers(0, 8))
    slots = draw(st.lists(st.integers(0, neutral), min_size=n_req, max_size=n_req))
    decode = draw(st.booleans())
    lens = None if decode else draw(st.lists(st.integers(0, 6), min_size=n_req, max_size=n_req))
    block_m = draw(st.sampled_from(block_ms))
    plan = plan_segments(slots, lens, block_m=block_m, skip_slot=neutral)
    if draw(st.booleans()):
        # Empty blocks must be no-ops whatever slot they name.
        extra = [(draw(st.integers(0, neutral)), p, p) for p in range(draw(st.integers(1, 3)))]
        plan = replace(plan, blocks=plan.blocks + extra)
    if draw(st.booleans()):
        pad = draw(st.integers(0, 5))
        static = StaticSegmentLayout(
            plan.num_rows + pad + 3, num_slots + 1 + 3, block_m, neutral, device
        )
        rows = plan.num_rows + pad
        # A view holds at most one block per row (real plans never need more); the padding
        # blocks it adds are empty ones.
        plan = replace(plan, blocks=plan.blocks[: static.blocks_for(rows)])
        static.write(plan, rows)
        return static.view(rows), plan.token_slots + [neutral] * pad
    return SegmentLayout.from_plan(plan, device), plan.token_slots


@st.composite
def linear_cases(draw, dtype, device):
    num_slots = draw(st.integers(1, 4))
    # About half the cases align every slice bound to 8 columns or more (``column_align``:
    # the kernels' vector accesses of y, on the GPU), the rest need not.
    aligned = draw(st.booleans())
    width = st.integers(1, 5).map(lambda w: 8 * w) if aligned else st.integers(1, 40)
    widths = draw(st.lists(width, min_size=1, max_size=3))
    k = draw(st.integers(1, 96))
    max_rank = draw(st.integers(1, 20))
    ranks = draw(
        st.lists(
            st.lists(st.integers(0, max_rank), min_size=len(widths), max_size=len(widths)),
            min_size=num_slots, max_size=num_slots,
        )
    )
    w = LoRAWeights.for_linear(num_slots, k, widths, max_rank, dtype, device)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    _fill(w, ranks, gen)
    layout, token_slots = draw(layouts(num_slots, device))
    split_k = draw(st.sampled_from([None, 1, 2, 3]))
    block_k = draw(st.sampled_from([None, 16, 32]))
    tiles = draw(st.sampled_from([None, 1, 2, 4]))
    return Case(w, layout, token_slots, split_k, block_k, tiles)


@st.composite
def embedding_cases(draw, dtype, device):
    num_slots = draw(st.integers(1, 4))
    vocab, hidden = draw(st.integers(1, 50)), draw(st.integers(1, 48))
    max_rank = draw(st.integers(1, 20))
    ranks = [[draw(st.integers(0, max_rank))] for _ in range(num_slots)]
    w = LoRAWeights.for_embedding(num_slots, vocab, hidden, max_rank, dtype, device)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    _fill(w, ranks, gen)
    layout, token_slots = draw(layouts(num_slots, device))
    return Case(w, layout, token_slots, None, None, draw(st.sampled_from([None, 1, 2])))


def defined_mask(case: Case) -> torch.Tensor:
    """[rows, slices*max_rank]: where the shrink output is defined (below the row slot's rank)."""
    w = case.weights
    r = w.max_rank
    out = torch.zeros(len(case.token_slots), w.num_slices * r, dtype=torch.bool)
    for t, slot in enumerate(case.token_slots):
        for s in range(w.num_slices):
            out[t, s * r : s * r + int(w.ranks[slot, s])] = True
    return out


def plan_is_valid(plan: SegmentPlan) -> None:
    """Invariants every plan must satisfy; raises AssertionError otherwise."""
    n = plan.num_rows
    assert sorted(plan.permutation) == list(range(n))
    for slot, lo, hi in plan.blocks:
        assert 0 <= lo <= hi <= n and hi - lo <= plan.block_m
        assert all(plan.token_slots[plan.permutation[p]] == slot for p in range(lo, hi))
