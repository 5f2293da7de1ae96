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

from lora_runtime.checks import is_positive_number

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
    MASTER_PORT). GPUs: rank r uses cuda:LOCAL_RANK. The collectives' timeout: DP_TIMEOUT_S
    where set, else ``timeout_s``, else ``DEFAULT_TIMEOUT_S``."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set: launch the ranks with torchrun or "
                               "lora_runtime.dp.launch.spawn")
    timeout_s = _timeout_s(timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        # The caller's group keeps the caller's timeout (torch's default: 10-30 minutes, which
        # a dead rank's peers would wait out): the DP collectives get a group of their own.
        group = dist.new_group(backend=backend, timeout=timeout)
    else:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else group
    return DPGroup(dist.get_rank(), dist.get_world_size(), group, cpu_group, timeout_s)


def _timeout_s(timeout_s: float | None) -> float:
    """The collectives' timeout in seconds: a finite number > 0 (0 timed the first connection
    out at once, NaN and text raised from the conversion naming neither, and an explicit 0
    was read as the default)."""
    env = os.environ.get("DP_TIMEOUT_S")
    if env is not None:
        try:
            value = float(env)
        except ValueError:
            value = None
        if value is None or not is_positive_number(value):
            raise ValueError(f"DP_TIMEOUT_S={env!r}: set it to a finite number of seconds > 0 "
                             "(the collectives' timeout), or unset it")
        return value
    return DEFAULT_TIMEOUT_S if timeout_s is None else checked_timeout_s(timeout_s)


def checked_timeout_s(timeout_s) -> float:
    """``timeout_s`` as a float, refused naming it unless a finite number of seconds > 0."""
    if not is_positive_number(timeout_s):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0 (the collectives' "
                         f"timeout), got {timeout_s!r}")
    return float(timeout_s)


def shutdown(device: torch.device) -> None:
    """Synchronises and leaves the group (graphs must be released first: a process holding
    captured collectives may not exit on its own)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not dist.is_initialized():
        return
    if dist.get_backend() != "gloo":
        dist.destroy_process_group()
        return
    # Hazard: a rank that tears its gloo pairs down while a peer still completes the last
    # collective aborts that peer ("terminate called without an active exception", SIGABRT;
    # seen in CI and in a bench run on 2 cores, once with a barrier before the teardown: the
    # barrier is itself a collective a peer may still be finishing). So: the barrier, then
    # through the store (no gloo pair) every rank says it is past it before any tears down,
    # and the store's host (rank 0) leaves last.
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    store.set(f"dp_shutdown/past_barrier/{rank}", "1")
    store.wait([f"dp_shutdown/past_barrier/{r}" for r in range(size)])
    if rank == 0:
        store.wait([f"dp_shutdown/left/{r}" for r in range(1, size)])
    dist.destroy_process_group()
    if rank != 0:
        store.set(f"dp_shutdown/left/{rank}", "1")
