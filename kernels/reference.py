"""Plain-torch versions of the three kernels: gather each row's adapter weights, then bmm.

Graph-safe by construction (no host syncs, no data-dependent Python control flow): rows of the
neutral slot, and columns past a slot's rank, are masked with ``torch.where``, never branched
on. Memory is ``rows x weights-per-row``, so this is a reference and a baseline, not a fast
path for large batches.
"""

from __future__ import annotations

import torch

from kernels.segments import SegmentLayout
from kernels.weights import LoRAWeights


def _row_slots(weights: LoRAWeights, layout: SegmentLayout) -> tuple[torch.Tensor, torch.Tensor]:
    slots = layout.token_slots.long()
    # The neutral slot has no weight row; its rank is 0, so whatever row the clamp picks is
    # masked out below.
    return slots, slots.clamp(max=weights.num_slots - 1)


def _rank_mask(weights: LoRAWeights, slots: torch.Tensor) -> torch.Tensor:
    """[rows, slices * max_rank] bool: column j of slice s is below the slot's rank."""
    r = weights.max_rank
    ranks = weights.ranks[slots].repeat_interleave(r, dim=1)
    cols = torch.arange(weights.num_slices * r, device=slots.device) % r
    return cols[None, :] < ranks


def shrink_reference(x: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout) -> torch.Tensor:
    slots, rows_w = _row_slots(weights, layout)
    a = torch.bmm(weights.lora_a[rows_w], x.unsqueeze(2)).squeeze(2).float()
    return torch.where(_rank_mask(weights, slots), a, 0.0)


def embedding_shrink_reference(
    token_ids: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout
) -> torch.Tensor:
    slots, rows_w = _row_slots(weights, layout)
    a = weights.lora_a[rows_w, token_ids.long()].float()
    return torch.where(_rank_mask(weights, slots), a, 0.0)


def expand_reference(
    a: torch.Tensor, weights: LoRAWeights, y: torch.Tensor, layout: SegmentLayout
) -> None:
    slots, rows_w = _row_slots(weights, layout)
    mask = _rank_mask(weights, slots)
    a = torch.where(mask, a, 0.0).to(y.dtype)
    r = weights.max_rank
    for s in range(weights.num_slices):
        lo, hi = weights.slice_bounds[s], weights.slice_bounds[s + 1]
        b = weights.lora_b[:, lo:hi][rows_w]
        delta = torch.bmm(b, a[:, s * r : (s + 1) * r].unsqueeze(2)).squeeze(2).float()
        scale = weights.scalings[slots, s].unsqueeze(1)
        live = (weights.ranks[slots, s] > 0).unsqueeze(1)
        out = y[:, lo:hi]
        out.copy_(torch.where(live, out.float() + scale * delta, out.float()).to(y.dtype))
