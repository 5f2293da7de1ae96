"""Named ranges in one NVTX domain ("multilora") for nsys timelines, and the same names as
torch-profiler ranges when a torch profiler is recording (the fallback trace of
``nox -s profile``). Importable from every floor above it (torch only).

Phases of a step: ``plan`` (LoRA segment planning on the host), ``buffer refresh`` (copies
into static buffers), ``replay`` (the graph launch), ``collective`` (DP agreement, gathers).
A range is never opened while a CUDA graph is being captured: host markers there would be
attributed to the capture, not to any replay.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:  # optional at run time: torch carries a binding (without domains)
    _nvtx = None

DOMAIN = "multilora"
PHASES = ("plan", "buffer refresh", "replay", "collective")


def _profiler_recording() -> bool:
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:
        return False


@contextlib.contextmanager
def nvtx_range(name: str):
    """A range named ``name``: NVTX on a GPU, a torch-profiler range while one records."""
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.is_current_stream_capturing():
        yield
        return
    with contextlib.ExitStack() as stack:
        if _profiler_recording():
            stack.enter_context(torch.profiler.record_function(name))
        if cuda and _nvtx is not None:
            stack.enter_context(_nvtx.annotate(name, domain=DOMAIN))
        elif cuda:
            torch.cuda.nvtx.range_push(name)
            stack.callback(torch.cuda.nvtx.range_pop)
        yield


def phase(name: str):
    """One of ``PHASES`` around the host or device work of a step."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; use one of {PHASES} (or nvtx_range for "
                         f"a free-form name)")
    return nvtx_range(name)
