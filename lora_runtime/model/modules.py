"""The one table of the model's adaptable modules, and every view derived from it.

Each row names a module as Hugging Face checkpoints and PEFT adapters name it (``q_proj``),
the fused module of this runtime that holds it (``qkv_proj``), its slice there, and the block
of a decoder layer it sits in (None: model level). The checkpoint loader, the LoRA wrap list,
the per-slot slices, the adapter shape checks and the tests all read this table."""

from __future__ import annotations

from dataclasses import dataclass

from lora_runtime.model.config import LlamaConfig


@dataclass(frozen=True)
class Target:
    name: str
    """Hugging Face / PEFT module name."""
    module: str
    """This runtime's (fused) module."""
    slice: int
    block: str | None
    """``self_attn`` or ``mlp`` inside a decoder layer; None at model level."""


TARGETS: tuple[Target, ...] = (
    Target("q_proj", "qkv_proj", 0, "self_attn"),
    Target("k_proj", "qkv_proj", 1, "self_attn"),
    Target("v_proj", "qkv_proj", 2, "self_attn"),
    Target("o_proj", "o_proj", 0, "self_attn"),
    Target("gate_proj", "gate_up_proj", 0, "mlp"),
    Target("up_proj", "gate_up_proj", 1, "mlp"),
    Target("down_proj", "down_proj", 0, "mlp"),
    Target("embed_tokens", "embed_tokens", 0, None),
    Target("lm_head", "lm_head", 0, None),
)
BY_NAME: dict[str, Target] = {t.name: t for t in TARGETS}
LINEAR_TARGETS: tuple[str, ...] = tuple(t.name for t in TARGETS if t.block is not None)
SLICES: dict[str, tuple[str, ...]] = {}
"""Fused module -> its target names in slice order."""
for _t in TARGETS:
    SLICES[_t.module] = (*SLICES.get(_t.module, ()), _t.name)
BLOCK_OF: dict[str, str | None] = {t.module: t.block for t in TARGETS}
"""Fused module -> its block (None at model level)."""
LAYER_MODULES: tuple[str, ...] = tuple(m for m, b in BLOCK_OF.items() if b is not None)
TENSOR_PARALLEL: dict[str, str] = {"gate_up_proj": "column", "down_proj": "row"}
"""Under DP attention the MLP is tensor-parallel: column-parallel modules keep 1/size of each
slice's outputs, row-parallel ones 1/size of their inputs. Other modules stay whole."""


def target(name: str) -> Target:
    if name not in BY_NAME:
        raise KeyError(f"unknown target module {name!r}; supported: {sorted(BY_NAME)}")
    return BY_NAME[name]


def module_path(layer: int | None, name: str) -> str:
    """The module's name inside a Hugging Face LlamaForCausalLM."""
    t = BY_NAME.get(name)
    if layer is None:
        return "model.embed_tokens" if name == "embed_tokens" else name
    block = f"{t.block}." if t is not None else ""  # unknown names still get a readable path
    return f"model.layers.{layer}.{block}{name}"


def in_out_features(config: LlamaConfig, name: str) -> tuple[int, int]:
    """(in, out) of one target; for embed_tokens, (vocab, hidden) like its PEFT lora_A/B."""
    t = target(name)
    shape = config.module_shape(t.module)
    return shape.in_features, shape.slice_widths[t.slice]
