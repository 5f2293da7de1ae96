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
            # Kept as a Python int: a numpy one (np.max of the adapters' ranks) passed here
            # and failed the first Triton LoRA launch (no int.bit_length on numpy ints).
            object.__setattr__(self, name, int(value))
        if isinstance(self.target_modules, str):  # read letter by letter
            raise ValueError(f"LoRAConfig.target_modules must be a tuple of module names, got "
                             f"{self.target_modules!r}; write ({self.target_modules!r},)")
        try:
            # Kept as a tuple: a list changed after the manager wrapped the model let adapters
            # for unwrapped modules past validation (a KeyError deep in the load), and a
            # generator, used up by the check below, left a runtime with no LoRA layers.
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        except TypeError as e:
            raise ValueError(f"LoRAConfig.target_modules must be a tuple of module names, got "
                             f"{self.target_modules!r}") from e
        if not all(isinstance(t, str) for t in self.target_modules):
            raise ValueError(f"LoRAConfig.target_modules must be a tuple of module names "
                             f"(str), got {self.target_modules!r}")
        unknown = set(self.target_modules) - set(BY_NAME)
        if unknown:
            raise ValueError(f"LoRAConfig.target_modules: unknown target modules "
                             f"{sorted(unknown)}; supported: {sorted(BY_NAME)}")

    @cached_property
    def runtime_modules(self) -> set[str]:
        """This runtime's (fused) modules that need LoRA buffers."""
        return {BY_NAME[t].module for t in self.target_modules}
