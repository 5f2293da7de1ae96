"""An adapter in host memory: per-module A/B with its rank and scaling, validated against a
model before it may enter the pool."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lora_runtime.checks import is_finite_number
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.modules import BY_NAME, LINEAR_TARGETS, in_out_features, module_path

ModuleKey = tuple[int | None, str]
"""(layer index, PEFT target name); layer is None for embed_tokens and lm_head."""


class AdapterError(ValueError):
    """A bad adapter (files, config, shapes, values). Loading it changes nothing."""


@dataclass
class ModuleLoRA:
    a: torch.Tensor
    """[r, in_features] (embed_tokens: PEFT's lora_embedding_A, [r, vocab])."""
    b: torch.Tensor
    """[out_features, r] (embed_tokens: [hidden, r])."""
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    modules: dict[ModuleKey, ModuleLoRA]
    r: int
    alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_layers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full base weights PEFT saves beside embedding LoRA (``save_embedding_layers``), by
    target (embed_tokens, lm_head). Served only if they equal the model's own."""

    def __post_init__(self) -> None:
        # None is no pattern, as PEFT's Optional fields and a config's null read (dict() of it
        # failed the load with a bare TypeError, .values() the save).
        if self.rank_pattern is None:
            self.rank_pattern = {}
        if self.alpha_pattern is None:
            self.alpha_pattern = {}
        if self.base_layers is None:  # likewise no base layer (the save raised on .items())
            self.base_layers = {}

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.modules}

    def to(self, dtype: torch.dtype) -> LoRAAdapter:
        # Detached: tensors of a model in training (nn.Parameter) made the slot image an
        # autograd result that kept them alive beside it (the weights held twice).
        mods = {k: ModuleLoRA(m.a.detach().to(dtype), m.b.detach().to(dtype), m.scaling)
                for k, m in self.modules.items()}
        return LoRAAdapter(self.name, mods, self.r, self.alpha, self.use_rslora,
                           self.target_modules, dict(self.rank_pattern), dict(self.alpha_pattern),
                           dict(self.base_layers))

    def fingerprint(self) -> int:
        """A digest of the weights and scalings (not the name), the same in every process: two
        ranks that loaded other weights under one name disagree on it."""
        crc = 0
        for key in sorted(self.modules, key=repr):
            m = self.modules[key]
            crc = zlib.crc32(repr((key, float(m.scaling), str(m.a.dtype), tuple(m.a.shape),
                                   tuple(m.b.shape))).encode(), crc)
            for t in (m.a, m.b):
                crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
        return crc & 0x7FFFFFFF

    def validate(self, config: LlamaConfig, max_rank: int, enabled: Iterable[str]) -> None:
        """Raises AdapterError naming the module, the expected value and the fix."""
        enabled = set(enabled)
        if not isinstance(self.modules, dict):
            raise AdapterError(f"adapter {self.name!r}: modules must be a dict of (layer, "
                               f"target) -> ModuleLoRA, got {type(self.modules).__name__}")
        if not self.modules:
            raise AdapterError(f"adapter {self.name!r} has no LoRA weights")
        for key, m in self.modules.items():
            layer, target = _check_key(self.name, key, config)
            where = f"adapter {self.name!r}, {module_path(layer, target)}"
            if not isinstance(m, ModuleLoRA):
                raise AdapterError(f"{where}: expected a ModuleLoRA(a, b, scaling), got "
                                   f"{type(m).__name__}")
            if target not in enabled:
                raise AdapterError(
                    f"{where}: the runtime was built without LoRA on {target!r} (targets: "
                    f"{sorted(enabled)}). Add it to LoRAConfig.target_modules"
                )
            for label, t in (("lora_A", m.a), ("lora_B", m.b)):
                if not isinstance(t, torch.Tensor) or t.dim() != 2:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise AdapterError(f"{where}: {label} must be a 2-D tensor, got {got}")
                if t.is_meta:  # every value check below raised a bare RuntimeError
                    raise AdapterError(f"{where}: {label} is a meta tensor (shapes, no data): "
                                       "load the adapter's weights before loading it")
            r = m.rank
            if r < 1:
                raise AdapterError(f"{where}: rank must be >= 1, got {r}")
            if r > max_rank:
                raise AdapterError(f"{where}: rank {r} exceeds max_rank {max_rank}. Build the "
                                   f"runtime with LoRAConfig(max_rank>={r})")
            want_a, want_b = expected_shapes(config, target, r)
            for label, t, want in (("lora_A", m.a, want_a), ("lora_B", m.b, want_b)):
                if tuple(t.shape) != want:
                    raise AdapterError(f"{where}: {label} has shape {tuple(t.shape)}, expected "
                                       f"{want} for this model")
                if not t.is_floating_point():  # a cast would serve its integers as weights
                    raise AdapterError(f"{where}: {label} has dtype {t.dtype}; LoRA weights must "
                                       "be floating point (dequantize the adapter before "
                                       "saving it)")
                if not torch.isfinite(t if t.element_size() > 1 else t.float()).all():  # fp8
                    raise AdapterError(f"{where}: {label} contains NaN or Inf")
            if not is_finite_number(m.scaling):
                raise AdapterError(f"{where}: scaling must be a finite number, got "
                                   f"{m.scaling!r}")
        self._validate_patterns()
        self._validate_base_layers(config)

    def _validate_patterns(self) -> None:
        for label in ("rank_pattern", "alpha_pattern"):
            value = getattr(self, label)
            if not isinstance(value, dict):
                raise AdapterError(f"adapter {self.name!r}: {label} must be a dict of module "
                                   f"regex -> value (None or {{}}: no pattern), got "
                                   f"{type(value).__name__} {value!r}")

    def _validate_base_layers(self, config: LlamaConfig) -> None:
        if not isinstance(self.base_layers, dict):
            raise AdapterError(f"adapter {self.name!r}: base_layers must be a dict of target -> "
                               f"tensor, got {type(self.base_layers).__name__}")
        want = (config.vocab_size, config.hidden_size)
        for target, t in self.base_layers.items():
            if target not in _BASE_LAYER_TARGETS:
                raise AdapterError(f"adapter {self.name!r}: base_layers key {target!r} is not one "
                                   f"of {list(_BASE_LAYER_TARGETS)} (the base layers PEFT saves)")
            if not isinstance(t, torch.Tensor) or t.is_meta:
                got = "a meta tensor (shapes, no data)" if isinstance(t, torch.Tensor) else (
                    type(t).__name__)
                raise AdapterError(f"adapter {self.name!r}: base_layers[{target!r}] must be a "
                                   f"tensor with data, got {got}")
            if tuple(t.shape) != want:
                raise AdapterError(
                    f"adapter {self.name!r} carries {target} weights of shape {tuple(t.shape)}, "
                    f"the model's are {want} (trained with a resized vocabulary?)"
                )
            where = f"adapter {self.name!r}, {module_path(None, target)}.base_layer.weight"
            fix = ("or save the adapter without it (PEFT: save_pretrained(..., "
                   "save_embedding_layers=False))")
            if not t.is_floating_point():  # torch.finfo, comparing it to the model's, raised
                raise AdapterError(f"{where} has dtype {t.dtype}, not floating point (a "
                                   f"quantized copy?): dequantize it {fix}")
            if not torch.isfinite(t if t.element_size() > 1 else t.float()).all():
                raise AdapterError(f"{where} contains NaN or Inf: fix it {fix}")


_BASE_LAYER_TARGETS = tuple(t for t, row in BY_NAME.items() if row.block is None)


def _check_key(name: str, key, config: LlamaConfig) -> ModuleKey:
    """``key`` as (layer, target) if it names a module of the model: a per-layer target with
    an existing layer, a model-level one (embed_tokens, lm_head) with None."""
    if not (isinstance(key, tuple) and len(key) == 2):
        raise AdapterError(f"adapter {name!r}: module key {key!r} is not (layer, target)")
    layer, target = key
    where = f"adapter {name!r}, module key {key!r}"
    if target not in BY_NAME:
        raise AdapterError(f"{where}: unknown target module {target!r}; supported: "
                           f"{sorted(BY_NAME)}")
    if BY_NAME[target].block is None:
        if layer is not None:
            raise AdapterError(f"{where}: {target} is a model-level module, not part of a "
                               f"decoder layer; key it (None, {target!r})")
        return key
    if layer is None:
        raise AdapterError(f"{where}: {target} sits in every decoder layer; key it (layer, "
                           f"{target!r}) with a layer in 0..{config.num_layers - 1}")
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise AdapterError(f"{where}: the layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < config.num_layers:
        raise AdapterError(f"{where}: layer {layer} does not exist (the model has "
                           f"{config.num_layers})")
    return key


def expected_shapes(config: LlamaConfig, target: str, r: int):
    """PEFT's (lora_A, lora_B) shapes of ``target`` at rank ``r``."""
    k, n = in_out_features(config, target)
    return (r, k), (n, r)


__all__ = ["LINEAR_TARGETS", "AdapterError", "LoRAAdapter", "ModuleLoRA", "expected_shapes",
           "module_path"]
