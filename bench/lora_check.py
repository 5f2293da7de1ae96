"""Correctness gate run inside every benchmark case before it is timed: the LoRA delta of a
provider against an fp32 computation grouped by slot (cheap enough for prefill-sized cases)."""

from __future__ import annotations

import torch

from kernels import LoRAWeights


def lora_delta_fp32(x: torch.Tensor, weights: LoRAWeights, token_slots: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], weights.lora_b.shape[1], dtype=torch.float32, device=x.device)
    slots = torch.tensor(token_slots, device=x.device)
    r_max = weights.max_rank
    for slot in sorted(set(token_slots)):
        if slot >= weights.num_slots:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        for s in range(weights.num_slices):
            r = int(weights.ranks[slot, s])
            if r == 0:
                continue
            a_w = weights.lora_a[slot, s * r_max : s * r_max + r].float()
            lo, hi = weights.slice_bounds[s], weights.slice_bounds[s + 1]
            b_w = weights.lora_b[slot, lo:hi, :r].float()
            scale = float(weights.scalings[slot, s])
            out[rows, lo:hi] = scale * (x[rows].float() @ a_w.t()) @ b_w.t()
    return out


def row_errors(y: torch.Tensor, y0: torch.Tensor, ref_delta: torch.Tensor) -> torch.Tensor:
    """Each row's relative error of the delta ``y - y0`` against ``ref_delta`` (inf where it
    is not finite). Per row: over the whole output, a fault confined to a few rows is diluted
    by the others (one row of 2048 without its term read 0.022, under bf16's limit)."""
    delta = y.float() - y0.float()
    err = (delta - ref_delta).norm(dim=-1) / ref_delta.norm(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(delta).all(dim=-1), err, float("inf"))
