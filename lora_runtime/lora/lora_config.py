"""``LoRAConfig``: the pool's size and the modules that get LoRA buffers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lora_runtime.checks import is_int
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
        for name in ("max_loras_per_batch", "max_rank"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"LoRAConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.target_modules, str):  # read letter by letter
            raise ValueError(f"LoRAConfig.target_modules must be a tuple of module names, got "
                             f"{self.target_modules!r}; write ({self.target_modules!r},)")
        unknown = set(self.target_modules) - set(BY_NAME)
        if unknown:
            raise ValueError(f"LoRAConfig.target_modules: unknown target modules "
                             f"{sorted(unknown)}; supported: {sorted(BY_NAME)}")

    @cached_property
    def runtime_modules(self) -> set[str]:
        """This runtime's (fused) modules that need LoRA buffers."""
        return {BY_NAME[t].module for t in self.target_modules}
