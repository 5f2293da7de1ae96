"""What every case of a run shares: the device, the ceilings measured in this run, the
repetitions and the profile name (for reproduce commands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.hardware import Ceilings


@dataclass(frozen=True)
class Context:
    device: torch.device
    ceilings: Ceilings
    reps: int
    profile: str
