"""Random adapters for benchmarks and tests (B is non-zero, unlike a fresh PEFT adapter)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lora_runtime.checks import is_int
from lora_runtime.lora.adapters.adapter import (
    LINEAR_TARGETS,
    LoRAAdapter,
    ModuleLoRA,
    expected_shapes,
)
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.modules import target as module_target


def random_adapter(
    config: LlamaConfig,
    name: str,
    rank: int,
    targets: Sequence[str] = LINEAR_TARGETS,
    *,
    alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    b_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    if not is_int(rank) or rank < 1:
        # rank 0 divided by zero computing the scaling; a float rank failed inside randn
        raise ValueError(f"random_adapter({name!r}): rank must be an integer >= 1, got {rank!r}")
    rank = int(rank)  # a numpy one (np.max of ranks), as LoRAConfig keeps it
    if isinstance(targets, str):  # read letter by letter: "unknown target module 'q'"
        raise ValueError(f"random_adapter({name!r}): targets must be a sequence of module "
                         f"names, got {targets!r}; write ({targets!r},)")
    targets = tuple(targets)  # a generator, read by the loop, left target_modules empty
    g = torch.Generator().manual_seed(seed)
    alpha = float(2 * rank if alpha is None else alpha)
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    modules = {}
    for target in targets:
        layers = [None] if module_target(target).block is None else range(config.num_layers)
        for layer in layers:
            (r, k), (n, _) = expected_shapes(config, target, rank)
            a_std = 1.0 if target == "embed_tokens" else k**-0.5
            a = torch.randn(r, k, generator=g) * a_std
            b = torch.randn(n, r, generator=g) * b_std
            modules[(layer, target)] = ModuleLoRA(a.to(dtype), b.to(dtype), scaling)
    return LoRAAdapter(name, modules, rank, alpha, use_rslora, targets)
