"""Two independent pieces of work as two branches of a CUDA graph.

While the current stream is capturing, ``run_beside`` forks a side stream from it, runs
``side`` there and ``main`` on the current stream, and joins the side stream back before
returning: the captured graph gets two parallel branches and a join, and a replay runs them
concurrently (the LoRA shrink next to the base GEMM it does not depend on). Outside a capture
(eager, CPU, traced graphs) both run in order on the current stream: in eager the stream
switches would cost more host time than the overlap saves.

Hazard (allocator): what ``side`` allocates belongs to the side stream. That is safe only
because every fork first makes the side stream wait for the current one: a block freed after
its last use on the current stream is reused on the side stream only after that use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

S = TypeVar("S")
M = TypeVar("M")

_streams: dict[tuple[int, bool], torch.cuda.Stream] = {}
ENABLED = os.environ.get("MULTILORA_SIDE_STREAM", "1") != "0"
"""``MULTILORA_SIDE_STREAM=0`` (read at import) turns the fork off: A/B runs, debugging."""
HIGH_PRIORITY_MIN_ROWS = int(os.environ.get("MULTILORA_SIDE_HIGH_PRIORITY_MIN_ROWS", "65"))
"""Forks of at least this many rows run their branch at the device's highest priority, fewer
at normal priority (read at import). High priority lets the branch's blocks take SMs as the
GEMM's retire, which a GEMM that fills the device needs, or the join waits on a branch still
queued; a decode GEMM leaves SMs free, and there the branch's blocks taking SMs first only
delays the GEMM. H200, 4 layers, 16 adapters, LoRA replay over base (six interleaved rounds,
us, highest / normal priority): decode bs 16 120 / 106, bs 64 117 / 113, bs 256 120 / 223;
prefill 256 tokens 208 / 163, 1024 tokens 228 / 426, 2048 tokens 613 / 837."""


def _side_stream(device: torch.device, high: bool) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, high) not in _streams:
        # Out-of-range priorities are clamped to the device's highest.
        _streams[index, high] = torch.cuda.Stream(device=index, priority=-100 if high else 0)
    return _streams[index, high]


def forking(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def run_beside(side: Callable[[], S], main: Callable[[], M], device: torch.device,
               rows: int) -> tuple[S, M]:
    """``(side(), main())``; under a CUDA graph capture the two run as parallel branches
    (``rows``: the forward's, which pick the branch's priority)."""
    if not forking(device):
        return side(), main()
    current = torch.cuda.current_stream(device)
    branch = _side_stream(device, rows >= HIGH_PRIORITY_MIN_ROWS)
    branch.wait_stream(current)
    with torch.cuda.stream(branch):
        side_out = side()
    main_out = main()
    current.wait_stream(branch)
    return side_out, main_out
