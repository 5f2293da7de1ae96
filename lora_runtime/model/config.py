"""Llama-architecture configuration and presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from lora_runtime.checks import is_int, is_positive_number


@dataclass(frozen=True)
class ModuleShape:
    name: str
    in_features: int
    slice_widths: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slice_widths)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if not is_int(self.head_dim) or self.head_dim < 0:
            raise ValueError(f"LlamaConfig.head_dim must be a positive integer (0: hidden_size / "
                             f"num_heads), got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must divide by num_heads, or set head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even for rotary embeddings, got "
                             f"{self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not is_positive_number(value):
                raise ValueError(f"LlamaConfig.{name} must be a positive finite number, got "
                                 f"{value!r}")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> ModuleShape:
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "qkv_proj": (h, (self.q_size, self.kv_size, self.kv_size)),
            "o_proj": (self.q_size, (h,)),
            "gate_up_proj": (h, (i, i)),
            "down_proj": (i, (h,)),
            "lm_head": (h, (self.vocab_size,)),
            "embed_tokens": (self.vocab_size, (h,)),
        }
        if module not in shapes:
            raise KeyError(f"unknown module {module!r}; expected one of {sorted(shapes)}")
        k, widths = shapes[module]
        return ModuleShape(module, k, widths)

    def with_layers(self, num_layers: int) -> LlamaConfig:
        return dataclasses.replace(self, num_layers=num_layers)

    @staticmethod
    def from_hf(cfg: dict) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of a Llama checkpoint."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"config.json has no {missing[0]!r} (a Llama config gives "
                             f"{', '.join(_REQUIRED)})")
        model_type, arch = cfg.get("model_type"), cfg.get("architectures")
        if (model_type is not None and model_type != "llama") or (
                arch is not None and "LlamaForCausalLM" not in arch):
            raise ValueError(f"not a Llama checkpoint: model_type={model_type!r}, "
                             f"architectures={arch!r} (this runtime serves LlamaForCausalLM)")
        if cfg.get("sliding_window") is not None:
            raise ValueError(f"sliding_window={cfg['sliding_window']!r} is not supported "
                             "(Llama attends to the whole context)")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{key}=true is not supported (Llama checkpoints have no biases)")
        if cfg.get("hidden_act") not in (None, "silu", "swish"):  # swish is transformers' silu
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; Llama's MLP "
                             "computes silu (also named swish)")
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"]
            method = method.get("quant_method") if isinstance(method, dict) else method
            raise ValueError(f"a quantized checkpoint (quantization_config, quant_method="
                             f"{method!r}) is not supported: dequantize it to bf16/fp16/fp32")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        return LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=_given(cfg.get("num_key_value_heads"), cfg["num_attention_heads"]),
            head_dim=_hf_head_dim(cfg.get("head_dim")),
            rms_norm_eps=_given(cfg.get("rms_norm_eps"), 1e-6),
            rope_theta=_hf_rope_theta(cfg.get("rope_theta"), rope),
            rope_scaling=rope,
            max_position_embeddings=_given(cfg.get("max_position_embeddings"), 4096),
            tie_word_embeddings=_hf_flag(cfg, "tie_word_embeddings"),
        )


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def _hf_flag(cfg: dict, key: str) -> bool:
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):  # bool("false") is True
        raise ValueError(f"config.json: {key} must be true or false, got {value!r}")
    return bool(value)


def _hf_head_dim(value) -> int:
    """config.json's ``head_dim``: null (or absent) derives it from hidden_size / heads; 0 is
    refused like any non-positive value (``LlamaConfig``'s own 0 means "derive", so it must
    not pass through)."""
    if value is None:
        return 0
    if not is_int(value) or value <= 0:
        raise ValueError(f"head_dim must be a positive integer, even for rotary embeddings, "
                         f"got {value!r} (null derives it from hidden_size / "
                         "num_attention_heads)")
    return value


def _hf_rope_theta(top, rope):
    """config.json's ``rope_theta``, or that of its rope dict (``rope_parameters`` in
    Hugging Face v5, which reads the dict's where both are given, v4 the top-level one)."""
    inner = rope.get("rope_theta") if isinstance(rope, dict) else None
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"config.json gives rope_theta={top!r} and {inner!r} in its rope "
                         "parameters: which one is meant is not known; keep one of them")
    return _given(top, inner, 10000.0)


def _given(*values):
    """The first value that is not None (config.json may hold an explicit null)."""
    return next(v for v in values if v is not None)


def _rope_scaling(rs: dict | None) -> dict | None:
    """``rope_scaling`` (or Hugging Face v5's ``rope_parameters``) checked: None for the
    default rotary frequencies, else the llama3 scaling's four keys."""
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rs]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}: config.json's rope_scaling "
                         f"must give {list(keys)}")
    _check_llama3(rs)
    return {k: rs[k] for k in keys} | {"rope_type": "llama3"}


def _check_llama3(rs: dict) -> None:
    """The values the rotary table divides by (a factor of 0 made it NaN)."""
    bad = [f"{k}={rs[k]!r}" for k in ("factor", "low_freq_factor", "high_freq_factor")
           if not is_positive_number(rs[k])]
    omp = rs["original_max_position_embeddings"]
    if not is_int(omp) or omp <= 0:
        bad.append(f"original_max_position_embeddings={omp!r}")
    if bad:
        raise ValueError(f"llama3 rope scaling: {', '.join(bad)}; the factors must be positive "
                         "numbers and original_max_position_embeddings a positive integer")
    lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
    if hi <= lo:  # the smoothing divides by hi - lo
        raise ValueError(f"llama3 rope scaling: high_freq_factor {hi} must exceed "
                         f"low_freq_factor {lo}")


def tiny(num_layers: int = 2) -> LlamaConfig:
    """CPU-test size: every code path, small enough for the Triton interpreter."""
    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=num_layers,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=512)


def llama3_8b(num_layers: int = 32) -> LlamaConfig:
    """Llama-3-8B shapes (random weights unless a checkpoint is loaded)."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=num_layers,
        num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=8192,
    )


PRESETS = {"tiny": tiny, "llama3-8b": llama3_8b}
