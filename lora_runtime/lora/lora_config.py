"""``LoRAConfig``: the pool's size and the modules that get LoRA buffers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lora_runtime.model.modules import BY_NAME, LINEAR_TARGETS


@dataclass(frozen=True)
class LoRAConfig:
    max_loras_per_batch: int = 4
    """GPU slots: the most distinct adapters one batch may use."""
    max_rank: int = 16
    target_modules: tuple[str, ...] = LINEAR_TARGETS
    """PEFT names (q_proj ... down_proj, embed_tokens, lm_head)."""
    backend: str = "triton"

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")
        unknown = set(self.target_modules) - set(BY_NAME)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}; supported: "
                             f"{sorted(BY_NAME)}")

    @cached_property
    def runtime_modules(self) -> set[str]:
        """This runtime's (fused) modules that need LoRA buffers."""
        return {BY_NAME[t].module for t in self.target_modules}
