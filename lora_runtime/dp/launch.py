"""Starting the ranks of a DP group: ``spawn(fn, size)`` runs ``fn(rank, *args)`` in ``size``
processes with torchrun's environment set (one GPU each when there are GPUs), so the same
rank code runs under ``torchrun --nproc-per-node N``. When any rank fails, the others are
terminated and ``spawn`` raises naming the rank and its error."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.multiprocessing as mp

from lora_runtime.checks import is_int
from lora_runtime.dp.group import checked_timeout_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, size: int, *args, timeout_s: float = 60.0) -> None:
    """Runs ``fn(rank, *args)`` on ``size`` ranks and waits for all of them. ``timeout_s``
    bounds every collective (a dead rank stops the others within it)."""
    if not is_int(size) or size < 1:
        raise ValueError(f"DP size must be an integer >= 1, got {size!r}")
    checked_timeout_s(timeout_s)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "DP_TIMEOUT_S": str(timeout_s)}
    mp.start_processes(_entry, args=(fn, env, args), nprocs=size, join=True,
                       start_method="spawn")


def _entry(rank: int, fn: Callable, env: dict, args: tuple) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    fn(rank, *args)
