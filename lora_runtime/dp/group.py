"""``DPGroup``: this rank's place in the data-parallel group and its two process groups: one
for the model's collectives (NCCL on GPUs, gloo on CPUs) and a gloo one for the host-side
step agreement. Collective timeouts are set here, never left at the defaults (tens of
minutes), so a dead or failing rank stops the others with an error in bounded time."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DPGroup:
    rank: int
    size: int
    group: dist.ProcessGroup
    """The model's collectives (gather before the MLP, reduce-scatter after)."""
    cpu_group: dist.ProcessGroup
    """Host-side agreement (gloo)."""
    timeout_s: float

    @property
    def name(self) -> str:
        return f"dp rank {self.rank}/{self.size}"


def init_dp(device: torch.device, timeout_s: float | None = None) -> DPGroup:
    """Joins the group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). GPUs: rank r uses cuda:LOCAL_RANK."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set: launch the ranks with torchrun or "
                               "lora_runtime.dp.launch.spawn")
    timeout_s = float(os.environ.get("DP_TIMEOUT_S", timeout_s or DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else \
        dist.group.WORLD
    return DPGroup(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, cpu_group,
                   timeout_s)


def shutdown(device: torch.device) -> None:
    """Synchronises and leaves the group (graphs must be released first: a process holding
    captured collectives may not exit on its own)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            # Hazard: a rank that tears its gloo pairs down while a peer still completes the
            # last collective aborts that peer ("terminate called without an active
            # exception", SIGABRT; seen once in CI on 2 cores): leave together.
            dist.barrier()
        dist.destroy_process_group()
