"""``--profile cpu`` runs on the CPU on any machine, a GPU machine included.

On a machine with a GPU, Triton compiles its kernels for the GPU (it picks the interpreter
only where no GPU is visible, when a kernel is decorated) and DP ranks take NCCL, so the CPU
profile's Triton cases read CPU tensors from GPU code ("cannot be accessed from Triton") and
its DP ranks asked for a GPU each. Hazard: ``select`` must run before torch initialises CUDA
and before ``kernels`` is imported, so the entry points call it before their other imports.
"""

from __future__ import annotations

import argparse
import os


def cpu_profile_requested(argv: list[str]) -> bool:
    """Whether ``argv`` (as ``python -m bench`` reads it) asks for the CPU profile."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--profile")
    try:
        known, _ = p.parse_known_args(argv)
    except SystemExit:  # e.g. --profile without a value: the real parser names it
        return False
    return known.profile == "cpu"


def select(argv: list[str]) -> None:
    """Hides the GPUs (this process and the DP ranks it spawns) and turns the Triton
    interpreter on where ``argv`` asks for the CPU profile."""
    if cpu_profile_requested(argv):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"
