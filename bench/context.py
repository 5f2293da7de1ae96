"""What every case of a run shares: the device, the ceilings measured in this run, the
repetitions, the profile name (for reproduce commands) and the NVML telemetry (the runner
records each whole case; a suite may open ``telemetry.span()`` around its timed part too,
e.g. for joules per token)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bench.hardware import Ceilings
from bench.telemetry import Telemetry


@dataclass(frozen=True)
class Context:
    device: torch.device
    ceilings: Ceilings
    reps: int
    profile: str
    telemetry: Telemetry = field(default_factory=Telemetry)
