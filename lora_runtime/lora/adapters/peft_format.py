"""Adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``
with PEFT key names. Everything is checked before anything is returned."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lora_runtime.lora.adapters.adapter import (
    LINEAR_TARGETS,
    AdapterError,
    LoRAAdapter,
    ModuleKey,
    ModuleLoRA,
    module_path,
)
from lora_runtime.model.modules import BY_NAME

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LAYER_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)
_BASE_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)\.base_layer\.weight$"
)
_TOP_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)"
    r"\.lora_(?:embedding_)?([AB])(?:\.default)?(?:\.weight)?$"
)
_UNSUPPORTED = {
    "use_dora": (True, "DoRA adapters are not supported"),
    "fan_in_fan_out": (True, "fan_in_fan_out=true is for Conv1D models, not Llama"),
}


def load_peft_adapter(path: str | Path, name: str | None = None) -> LoRAAdapter:
    path = Path(path)
    name = name or path.name
    cfg = _read_config(path)
    tensors = _read_weights(path)
    r = cfg.get("r")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"{path / CONFIG}: 'r' must be a positive integer, got {r!r}")
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    use_rslora = bool(cfg.get("use_rslora", False))
    targets = _targets(cfg.get("target_modules"), path)
    pairs: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    base_layers = {}
    for key, t in tensors.items():
        if m := _BASE_KEY.match(key):
            base_layers[m.group(1)] = t
            continue
        mk, ab = _parse_key(key, path)
        pairs.setdefault(mk, {})[ab] = t
    modules = {}
    for mk, ab in sorted(pairs.items(), key=lambda kv: (kv[0][0] or -1, kv[0][1])):
        where = f"{path}: {module_path(*mk)}"
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(f"{where}: lora_{missing} is missing from {WEIGHTS}")
        if targets is not None and mk[1] not in targets:
            raise AdapterError(f"{where}: has weights but target_modules {sorted(targets)} does "
                               f"not name {mk[1]!r}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"{where}: lora_A/lora_B must be 2-D, got {tuple(a.shape)} and "
                               f"{tuple(b.shape)}")
        mod_r = int(_pattern_value(rank_pattern, module_path(*mk), r))
        if a.shape[0] != mod_r or b.shape[1] != mod_r:
            raise AdapterError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                               f"not have rank {mod_r} as the config says")
        mod_alpha = float(_pattern_value(alpha_pattern, module_path(*mk), alpha))
        scaling = mod_alpha / (mod_r**0.5 if use_rslora else mod_r)
        modules[mk] = ModuleLoRA(a, b, scaling)
    return LoRAAdapter(name, modules, r, float(alpha), use_rslora,
                       tuple(sorted(targets or {t for _, t in modules})),
                       dict(rank_pattern), dict(alpha_pattern), base_layers)


def save_peft_adapter(adapter: LoRAAdapter, path: str | Path, base_model: str = "") -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, target), m in adapter.modules.items():
        prefix = f"base_model.model.{module_path(layer, target)}"
        if target == "embed_tokens":
            tensors[f"{prefix}.lora_embedding_A"] = m.a.contiguous()
            tensors[f"{prefix}.lora_embedding_B"] = m.b.contiguous()
        else:
            tensors[f"{prefix}.lora_A.weight"] = m.a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = m.b.contiguous()
    save_file(tensors, str(path / WEIGHTS))
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": adapter.r, "lora_alpha": adapter.alpha, "use_rslora": adapter.use_rslora,
        "target_modules": sorted(adapter.targets), "rank_pattern": adapter.rank_pattern,
        "alpha_pattern": adapter.alpha_pattern, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    }
    (path / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory (expected a PEFT adapter "
                           f"folder with {CONFIG} and {WEIGHTS})")
    f = path / CONFIG
    if not f.is_file():
        raise AdapterError(f"{f} is missing: not a PEFT adapter folder")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{f}: peft_type {cfg['peft_type']!r} is not LORA")
    for key, (bad, why) in _UNSUPPORTED.items():
        if cfg.get(key) == bad:
            raise AdapterError(f"{f}: {why} ({key}={bad})")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{f}: bias={cfg['bias']!r} is not supported (LoRA biases); "
                           "retrain with bias='none'")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{f}: modules_to_save={cfg['modules_to_save']} is not supported "
                           "(fully trained modules are not LoRA)")
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    f = path / WEIGHTS
    if not f.is_file():
        extra = " (adapter_model.bin is not read: re-save it with safetensors)" if (
            path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{f} is missing{extra}")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"{f} could not be read (corrupt safetensors?): {e}") from e


def _targets(raw, path: Path) -> set[str] | None:
    """The PEFT target names the config allows; None for a regex (weights decide)."""
    if raw is None:
        raise AdapterError(f"{path / CONFIG}: target_modules is missing")
    if raw == "all-linear":
        return set(LINEAR_TARGETS)
    if isinstance(raw, str):
        return None
    names = set()
    for t in raw:
        leaf = str(t).rsplit(".", 1)[-1]
        if leaf not in BY_NAME:
            raise AdapterError(f"{path / CONFIG}: unknown target module {t!r}; supported: "
                               f"{sorted(BY_NAME)}")
        names.add(leaf)
    return names


def _parse_key(key: str, path: Path) -> tuple[ModuleKey, str]:
    m = _LAYER_KEY.match(key)
    if m:
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in BY_NAME:
            raise AdapterError(f"{path / WEIGHTS}: key {key!r} targets unknown module "
                               f"{target!r}; supported: {sorted(BY_NAME)}")
        return (layer, target), ab
    m = _TOP_KEY.match(key)
    if m:
        return (None, m.group(1)), m.group(2)
    raise AdapterError(f"{path / WEIGHTS}: unrecognised key {key!r} (not a LoRA weight of a "
                       "Llama module)")


def _pattern_value(patterns: dict, module: str, default):
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return value
    return default
