"""How a LoRA linear is ordered around its base GEMM: ``y = base(x) + expand(shrink(x))``.

The shrink reads only ``x``, so inside a CUDA graph capture it becomes a parallel branch
beside the GEMM (``side_stream``) and the expand adds into ``y`` after the join
(``beside``). Outside a capture (eager, CPU, traced graphs) everything runs in stream order
(``serial``).

Measured on the H200 (kernel suite, 2b162f9; LoRA's added time over the four modules, as a
share of their GEMMs): beside 16.7 / 24.7 / 22.9 / 69.1% at T = 1 / 16 / 64 / 256, serial
25.4 / 37.9 / 34.5 / 73.9%. A third schedule, expanding beside the GEMM into a float32
delta added after the join, lost to both at every decode size (22.0 / 39.8 / 40.9 /
117.9%): the side branch then no longer fits beside the GEMM, and the add costs what the
expand did. Inside the model that schedule returned for forwards of one or two rows, with
the add folded into the kernel after the projection (``LoRABackend.linear_delta``,
``config.DELTA_MAX_ROWS``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lora_runtime.lora.side_stream import forking, run_beside

Shrink = Callable[[torch.Tensor], torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor], None]
SCHEDULES = ("beside", "serial")


def schedule_for(x: torch.Tensor) -> str:
    return "beside" if forking(x) else "serial"


def lora_linear(base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shrink: Shrink,
                expand: Expand, schedule: str | None = None) -> torch.Tensor:
    """``base(x)`` plus the LoRA term, in ``schedule`` (default: ``schedule_for(x)``)."""
    schedule = schedule or schedule_for(x)
    if schedule == "beside":
        a, y = run_beside(lambda: shrink(x), lambda: base(x), x)
    elif schedule == "serial":
        y = base(x)
        a = shrink(x)
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    expand(a, y)
    return y
