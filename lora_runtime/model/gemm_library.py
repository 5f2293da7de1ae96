"""cuBLAS settings for the base GEMMs of a CUDA graph capture.

cuBLAS reads its library (cuBLAS or cuBLASLt) and SM count target at each call, and a CUDA
graph bakes in the kernel the call launched: a setting held around a capture holds for every
replay of it, at no cost to the replay's host. Outside a capture nothing changes.

``rows_library``: the library for a whole captured forward, by its rows
(``config.CAPTURE_GEMM_LT_ROWS``). ``sms_left_free``: a GEMM with the LoRA term computed
beside it leaves SMs to that branch (``config.DELTA_GEMM_SMS_FREE``); only cuBLASLt honours
the SM count target, so it also picks cuBLASLt.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kernels import config


@contextmanager
def rows_library(rows: int, device: torch.device):
    """cuBLASLt for every GEMM inside where a capture of ``rows`` rows on a CUDA ``device``
    falls in ``config.CAPTURE_GEMM_LT_ROWS``; cuBLAS's default otherwise."""
    lo, hi = config.CAPTURE_GEMM_LT_ROWS
    with _blas(device.type == "cuda" and lo <= rows <= hi, None):
        yield


@contextmanager
def sms_left_free(x: torch.Tensor):
    """For a GEMM of ``x``'s rows with the LoRA term beside it (a capture): cuBLASLt told to
    leave ``config.DELTA_GEMM_SMS_FREE`` SMs free where ``x`` has at least its row count."""
    min_rows, sms = config.DELTA_GEMM_SMS_FREE
    on = sms > 0 and x.shape[0] >= min_rows and _on_gpu(x)
    with _blas(on, sms if on else None):
        yield


def _on_gpu(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


@contextmanager
def _blas(lt: bool, carveout: int | None):
    if not lt:
        yield
        return
    library = torch.backends.cuda.preferred_blas_library()
    saved_carveout = torch._C._get_sm_carveout_experimental()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        if carveout is not None:
            torch._C._set_sm_carveout_experimental(carveout)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(saved_carveout)
        torch.backends.cuda.preferred_blas_library(library)
