"""``LoRAConfig`` refuses, naming the field, limits that are not integers and target modules
given as one string (they failed later, deep in the manager, naming neither)."""

from __future__ import annotations

import pytest

from lora_runtime.lora.lora_config import LoRAConfig


@pytest.mark.parametrize("field, value, words", [
    ("max_loras_per_batch", 2.5, "an integer >= 1"),  # TypeError building the slot pool
    ("max_loras_per_batch", "2", "an integer >= 1"),
    ("max_loras_per_batch", True, "an integer >= 1"),  # served as one slot
    ("max_rank", 8.5, "an integer >= 1"),  # TypeError allocating the LoRA weights
    ("max_rank", True, "an integer >= 1"),
    ("max_rank", 0, "an integer >= 1"),
    ("target_modules", "q_proj", r"a tuple of module names.*\('q_proj',\)"),
    ("target_modules", ["q_proj", "nope"], "unknown target modules"),
])
def test_lora_config_refuses_bad_fields(field, value, words):
    with pytest.raises(ValueError, match=f"LoRAConfig.{field}.*{words}"):
        LoRAConfig(**{field: value, "backend": "torch"})

