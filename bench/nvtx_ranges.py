"""NVTX ranges that name each benchmark case, so ``nsys`` timelines and ``ncu --nvtx-include``
can pick them out. Falls back to torch's NVTX binding, and to nothing off the GPU."""

from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:  # the nvtx wheel is optional at run time; torch carries a binding too
    _nvtx = None


@contextlib.contextmanager
def range(name: str):  # noqa: A001  (mirrors nvtx.annotate / torch.cuda.nvtx.range)
    if not torch.cuda.is_available():
        yield
        return
    if _nvtx is not None:
        with _nvtx.annotate(name, domain="multilora"):
            yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
