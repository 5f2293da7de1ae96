"""The MLP's two collectives under DP attention, written with functional collectives so a
trace (the CPU stand-in) records them as ops and a CUDA graph captures them; each result is
waited on where it is produced (an un-waited result fails after a graph replay).

Rows are laid out rank after rank, each rank's padded to ``rows_per_rank`` (agreed by every
rank for the step), so both collectives have equal sizes on every rank."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from lora_runtime.dp.group import DPGroup

# Same signatures; newer torch renames them (and deprecates the old names).
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


def gather_rows(x: torch.Tensor, rows_per_rank: int, dp: DPGroup) -> torch.Tensor:
    """[t, H] local rows (t <= rows_per_rank) -> [size * rows_per_rank, H]."""
    if x.shape[0] > rows_per_rank:
        raise ValueError(f"{dp.name}: {x.shape[0]} local rows exceed the agreed "
                         f"{rows_per_rank} rows per rank")
    if x.shape[0] < rows_per_rank:
        x = F.pad(x, (0, 0, 0, rows_per_rank - x.shape[0]))
    return funcol.wait_tensor(_all_gather(x.contiguous(), 0, dp.group))


def reduce_scatter_rows(y: torch.Tensor, dp: DPGroup) -> torch.Tensor:
    """[size * rows_per_rank, H] partial sums -> this rank's [rows_per_rank, H] of the sum."""
    return funcol.wait_tensor(_reduce_scatter(y.contiguous(), "sum", 0, dp.group))

