"""Two independent pieces of work as two branches of a CUDA graph.

While the current stream is capturing, ``run_beside`` forks a side stream from it, runs
``side`` there and ``main`` on the current stream, and joins the side stream back before
returning: the captured graph gets two parallel branches and a join, and a replay runs them
concurrently (the LoRA shrink next to the base GEMM it does not depend on). Outside a capture
(eager, CPU, traced graphs) both run in order on the current stream: in eager the stream
switches would cost more host time than the overlap saves. So do forwards of more than
``config.FORK_MAX_ROWS`` rows, whose GEMMs fill the device: a branch beside them only takes
SMs from them.

Hazard (allocator): what ``side`` allocates belongs to the side stream. That is safe only
because every fork first makes the side stream wait for the current one: a block freed after
its last use on the current stream is reused on the side stream only after that use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from kernels import config

S = TypeVar("S")
M = TypeVar("M")

_streams: dict[int, torch.cuda.Stream] = {}
ENABLED = os.environ.get("MULTILORA_SIDE_STREAM", "1") != "0"
"""``MULTILORA_SIDE_STREAM=0`` (read at import) turns the fork off: A/B runs, debugging."""


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        # Highest priority: the side branch is short and the join waits for it, so its blocks
        # should take SMs as the main branch's blocks retire. (Out-of-range priorities are
        # clamped to the device's highest.)
        _streams[index] = torch.cuda.Stream(device=index, priority=-100)
    return _streams[index]


def forking(x: torch.Tensor) -> bool:
    """Whether work on ``x`` (the rows of a forward) forks a branch beside the main stream."""
    return (ENABLED and x.device.type == "cuda" and x.shape[0] <= config.FORK_MAX_ROWS
            and torch.cuda.is_current_stream_capturing())


def run_beside(side: Callable[[], S], main: Callable[[], M],
               x: torch.Tensor) -> tuple[S, M]:
    """``(side(), main())`` for a forward of ``x``'s rows; where ``forking(x)`` (a CUDA graph
    capture) the two run as parallel branches."""
    if not forking(x):
        return side(), main()
    device = x.device
    current = torch.cuda.current_stream(device)
    branch = _side_stream(device)
    branch.wait_stream(current)
    # Hazard: a fork left unjoined when a branch raises fails the capture's end with CUDA's
    # "unjoined" error, which replaced the branch's own and left the capture's stream current.
    try:
        with torch.cuda.stream(branch):
            side_out = side()
        main_out = main()
    finally:
        current.wait_stream(branch)
    return side_out, main_out
