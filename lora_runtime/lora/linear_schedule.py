"""How a LoRA linear is ordered around its base GEMM: ``y = base(x) + expand(shrink(x))``.

Neither LoRA kernel needs the GEMM's output except the expand's final add, so inside a CUDA
graph capture they become a parallel branch (``side_stream``):

- ``beside``: the shrink runs beside the GEMM; the expand adds into ``y`` after it.
- ``delta``: shrink and expand both run beside the GEMM, the expand into a zeroed float32
  ``delta``; after the join one elementwise add folds it into ``y``. The critical path
  loses the expand (the costlier kernel at decode) for an add of ``rows x out`` elements,
  so it pays only while that add is small: up to ``DELTA_MAX_ROWS`` rows.
- ``serial``: outside a capture (eager, CPU, traced graphs), everything in stream order.

Rounding: ``delta`` is float32 and the add computes in float32, so ``y`` is rounded once,
to the same value as the in-place expand's ``y + scale * acc``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from lora_runtime.lora.side_stream import forking, run_beside

DELTA_MAX_ROWS = int(os.environ.get("MULTILORA_DELTA_MAX_ROWS", "256"))
"""Graph batches of at most this many rows use ``delta`` mode (0 turns it off)."""

Shrink = Callable[[torch.Tensor], torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor], None]


def schedule_for(x: torch.Tensor) -> str:
    if not forking(x.device):
        return "serial"
    return "delta" if x.shape[0] <= DELTA_MAX_ROWS else "beside"


def lora_linear(base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shrink: Shrink,
                expand: Expand, out_features: int, schedule: str | None = None) -> torch.Tensor:
    """``base(x)`` plus the LoRA term, in ``schedule`` (default: ``schedule_for(x)``)."""
    schedule = schedule or schedule_for(x)
    if schedule == "delta":
        def lora_term() -> torch.Tensor:
            delta = torch.zeros(x.shape[0], out_features, dtype=torch.float32,
                                device=x.device)
            expand(shrink(x), delta)
            return delta

        delta, y = run_beside(lora_term, lambda: base(x), x.device)
        return y.add_(delta)
    if schedule == "beside":
        a, y = run_beside(lambda: shrink(x), lambda: base(x), x.device)
    elif schedule == "serial":
        y = base(x)
        a = shrink(x)
    else:
        raise ValueError(f"schedule must be 'delta', 'beside' or 'serial', got {schedule!r}")
    expand(a, y)
    return y
