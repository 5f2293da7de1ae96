"""Which kernels the base step runs: ``triton`` (``kernels/``: attention, RMSNorm, RoPE + KV
write, SwiGLU; the default on a GPU) or ``torch`` (the reference; the default on a CPU, where
Triton runs in its slow interpreter).

The backend is read when a forward runs, so a captured graph keeps the one it was captured
with. Both are graph-safe: no host syncs, no data-dependent Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kernels.checks import FLOAT_DTYPES
from kernels.config import interpreted

BACKENDS = ("triton", "torch")
_backend = "triton" if torch.cuda.is_available() else "torch"


def base_backend(device: torch.device | None = None, dtype: torch.dtype | None = None) -> str:
    """The backend a forward on ``device`` in ``dtype`` runs: the selected one, except
    ``torch`` for CPU tensors while Triton is not interpreting (a compiled Triton kernel
    cannot read host memory: a CPU run on a GPU machine) and for a dtype the kernels do not
    take (a float64 model, which the model serves, failed its first norm's check)."""
    if _backend == "triton" and (
            (device is not None and device.type != "cuda" and not interpreted())
            or (dtype is not None and dtype not in FLOAT_DTYPES)):
        return "torch"
    return _backend


def set_base_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"base-step backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextmanager
def use_base_backend(name: str) -> Iterator[None]:
    previous = _backend
    set_base_backend(name)
    try:
        yield
    finally:
        set_base_backend(previous)
