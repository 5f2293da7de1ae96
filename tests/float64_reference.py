"""Float64 ground truth for the LoRA kernels, written row by row from the definition."""

from __future__ import annotations

import torch

from kernels import LoRAWeights


def lora_delta_f64(
    x: torch.Tensor, weights: LoRAWeights, token_slots: list[int], token_ids=None,
    magnitude: bool = False,
) -> torch.Tensor:
    """``scaling * B @ A @ x`` per row and slice, in float64. ``token_ids``: embedding LoRA.
    ``magnitude``: the same over absolute values, ``|scaling| |B| |A| |x|``: what a rounding
    error of the term scales with (a term that cancels, ``A @ x`` small against ``|A| |x|``,
    is computed to an error relative to this, not to itself)."""
    m = torch.abs if magnitude else (lambda t: t)
    rows = len(token_slots)
    out = torch.zeros(rows, weights.lora_b.shape[1], dtype=torch.float64)
    r_max = weights.max_rank
    for t, slot in enumerate(token_slots):
        if slot >= weights.num_slots:
            continue
        for s in range(weights.num_slices):
            r = int(weights.ranks[slot, s])
            if r == 0:
                continue
            if weights.is_embedding:
                a = m(weights.lora_a[slot, int(token_ids[t]), :r].double().cpu())
            else:
                a_w = weights.lora_a[slot, s * r_max : s * r_max + r].double().cpu()
                a = m(a_w) @ m(x[t].double().cpu())
            lo, hi = weights.slice_bounds[s], weights.slice_bounds[s + 1]
            b = m(weights.lora_b[slot, lo:hi, :r].double().cpu())
            out[t, lo:hi] = abs(float(weights.scalings[slot, s])) * (b @ a) if magnitude else (
                float(weights.scalings[slot, s]) * (b @ a))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def assert_added(y: torch.Tensor, y0: torch.Tensor, delta_ref: torch.Tensor, dtype,
                 magnitude: torch.Tensor | None = None) -> None:
    """``y == y0 + delta_ref`` up to TOL relative to the delta's ``magnitude`` (default: the
    delta itself; ``lora_delta_f64(..., magnitude=True)`` where the term may cancel), plus the
    final rounding of y (which no kernel can beat: ``UNIT_ROUNDOFF * |y|`` per element)."""
    y, target = y.double().cpu(), y0.double().cpu() + delta_ref.double().cpu()
    assert torch.isfinite(y).all(), "non-finite output"
    err = (y - target).norm().item()
    scale = (delta_ref if magnitude is None else magnitude).norm().item()
    allowed = TOL[dtype] * scale + 2 * UNIT_ROUNDOFF[dtype] * target.norm().item()
    assert err <= allowed + 1e-300, f"|y - ref| = {err:.3e} > allowed {allowed:.3e}"
