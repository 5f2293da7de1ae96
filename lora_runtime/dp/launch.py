"""Starting the ranks of a DP group: ``spawn(fn, size)`` runs ``fn(rank, *args)`` in ``size``
processes with torchrun's environment set (one GPU each when there are GPUs), so the same
rank code runs under ``torchrun --nproc-per-node N``. When any rank fails, the others are
terminated and ``spawn`` raises naming the rank and its error. A rank whose ``fn`` returned
leaves at once, without the interpreter's teardown: ``fn`` closes what it writes."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from lora_runtime.checks import is_int
from lora_runtime.dp.group import checked_timeout_s, resolved_timeout_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, size: int, *args, timeout_s: float = 60.0) -> None:
    """Runs ``fn(rank, *args)`` on ``size`` ranks and waits for all of them. ``timeout_s``
    bounds every collective (a dead rank stops the others within it); ``DP_TIMEOUT_S``, where
    set, wins, as in ``init_dp``."""
    if not is_int(size) or size < 1:
        raise ValueError(f"DP size must be an integer >= 1, got {size!r}")
    checked_timeout_s(timeout_s)
    timeout_s = resolved_timeout_s(timeout_s)  # it was overwritten in the ranks' environment
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "DP_TIMEOUT_S": str(timeout_s)}
    mp.start_processes(_entry, args=(fn, env, args), nprocs=size, join=True,
                       start_method="spawn")


def _entry(rank: int, fn: Callable, env: dict, args: tuple) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    if torch.cuda.is_available() and rank < torch.cuda.device_count():
        torch.cuda.set_device(rank)  # its GPU current, as the module says (it was not)
    faulthandler.enable()  # a rank that aborts prints its Python stack, not a bare signal
    fn(rank, *args)
    _leave_now()


def _leave_now() -> None:
    """Ends a rank whose work is done, skipping the interpreter's teardown. Hazard: that
    teardown may abort a rank that shut its gloo group down cleanly ("terminate called
    without an active exception", SIGABRT, after its results were written: 1 CI run in
    about 60), which failed the whole spawn. Profilers keep their data: CUDA work is
    finished and the profiler API flushed (what the driver's own exit would do)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        with contextlib.suppress(Exception):  # none attached, or a driver without it
            torch.cuda.profiler.stop()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
