"""Triton segmented-GEMM kernels for multi-LoRA, their launchers and a plain-torch reference.

Triton kernels run on CPU tensors only under its interpreter, which is chosen when a kernel is
decorated. On a machine without CUDA we switch the interpreter on before any kernel module is
imported, so every entry point (tests, benchmarks, the runtime) behaves the same.
"""

import os

import torch

# lora_runtime checks this: Hugging Face's `kernels` package (transformers >= 5.25 requires it)
# has the same import name and may shadow or overwrite this one.
PROJECT = "multilora-graphs"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.embedding import lora_embedding_shrink  # noqa: E402
from kernels.expand import lora_expand  # noqa: E402
from kernels.segments import (  # noqa: E402
    SegmentLayout,
    SegmentPlan,
    SegmentSpec,
    StaticSegmentLayout,
    plan_segments,
)
from kernels.shrink import lora_shrink, lora_shrink_with_delta  # noqa: E402
from kernels.shrink_expand import lora_shrink_expand  # noqa: E402
from kernels.weights import LoRAWeights  # noqa: E402

__all__ = [
    "LoRAWeights",
    "SegmentLayout",
    "SegmentPlan",
    "SegmentSpec",
    "StaticSegmentLayout",
    "lora_embedding_shrink",
    "lora_expand",
    "lora_shrink",
    "lora_shrink_expand",
    "lora_shrink_with_delta",
    "plan_segments",
]
