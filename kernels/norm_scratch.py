"""The counters and partial sums of the norms whose rows several programs share
(``kernels.rms_norm_windows``, ``kernels.rms_norm_split``): the last program of a row (or of
a window of rows) to finish, told by an atomic counter, reads the others' partial sums of
squares and normalises. One scratch per device, which every such launch leaves as it found
it (the last program sets its counter back to zero), so no memset precedes a launch.

Hazards: launches sharing the scratch must not overlap: the runtime's eager forwards and graph
replays run on one stream, and no side branch runs a norm. A captured graph keeps the
scratch's addresses, so a scratch outgrown is retired, never freed (a graph captured before
still replays on it, zero as it was left).
"""

from __future__ import annotations

import torch

_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[torch.Tensor] = []
"""Scratch outgrown: kept alive for the graphs captured on it."""


def norm_scratch(device: torch.device, counters: int, parts: int) -> tuple:
    """``(count, part)``: at least ``counters`` int32 counters, zero, and ``parts`` float32
    partial sums: the device's scratch, grown when too small (counters zeroed then)."""
    count, part = _scratch.get(device, (None, None))
    if count is None or count.numel() < counters:
        _retired.extend(t for t in (count,) if t is not None)
        count = torch.zeros(max(2 * counters, 1024), dtype=torch.int32, device=device)
    if part is None or part.numel() < parts:
        _retired.extend(t for t in (part,) if t is not None)
        part = torch.empty(max(2 * parts, 65536), dtype=torch.float32, device=device)
    _scratch[device] = count, part
    return count, part
