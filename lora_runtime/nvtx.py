"""Named ranges in one NVTX domain ("multilora") for nsys timelines, and the same names as
torch-profiler ranges when a torch profiler is recording (the fallback trace of
``nox -s profile``). Importable from every floor above it (torch only).

Phases of a step: ``plan`` (LoRA segment planning on the host), ``buffer refresh`` (copies
into static buffers), ``replay`` (the graph launch), ``collective`` (DP agreement, gathers).
A range is never opened while a CUDA graph is being captured: host markers there would be
attributed to the capture, not to any replay.
"""

from __future__ import annotations

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


_cuda: bool | None = None


def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once (1-2 us a call; a step opens several ranges)."""
    global _cuda
    if _cuda is None:
        _cuda = torch.cuda.is_available()
    return _cuda


class nvtx_range:  # noqa: N801 (used as a context manager, like a function)
    """A range named ``name``: NVTX on a GPU, a torch-profiler range while one records. A
    class, not a generator context manager: every serving step opens several (a few us each
    as a generator with an ExitStack on the H200 host)."""

    __slots__ = ("name", "_record", "_pushed")

    def __init__(self, name: str) -> None:
        self.name = name
        self._record = None
        self._pushed = False

    def __enter__(self) -> None:
        cuda = _cuda_available()
        if cuda and torch.cuda.is_current_stream_capturing():
            return
        if _profiler_recording():
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()
        if cuda:
            if _nvtx is not None:
                _nvtx.push_range(self.name, domain=DOMAIN)
            else:
                torch.cuda.nvtx.range_push(self.name)
            self._pushed = True

    def __exit__(self, *exc) -> None:
        if self._pushed:
            self._pushed = False
            if _nvtx is not None:
                _nvtx.pop_range(domain=DOMAIN)
            else:
                torch.cuda.nvtx.range_pop()
        if self._record is not None:
            record, self._record = self._record, None
            record.__exit__(*exc)


def phase(name: str):
    """One of ``PHASES`` around the host or device work of a step."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; use one of {PHASES} (or nvtx_range for "
                         f"a free-form name)")
    return nvtx_range(name)
