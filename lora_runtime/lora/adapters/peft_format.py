"""Adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``
with PEFT key names. Everything is checked before anything is returned."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lora_runtime.checks import is_finite_number, is_int
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
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)
_BASE_KEY = re.compile(  # without base_layer: saved with save_embedding_layers=True, untargeted
    r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)(?:\.base_layer)?\.weight$"
)
_TOP_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)"
    r"\.lora_(embedding_)?([AB])(?:\.default)?(?:\.weight)?$"
)
_MERGE_FIX = ("merge the adapter into the base model (PEFT: merge_and_unload()) and serve the "
              "merged model")
_IGNORED_FLAGS = ("fan_in_fan_out",)
"""Checked as flags, then ignored, as PEFT does on Llama: it resets fan_in_fan_out to false on
nn.Linear targets, and its embedding forward does not read it (a plain LoRA either way)."""
_CHANGES_THE_FORWARD = {  # PEFT options that make the adapter more than x A^T B^T s
    "alora_invocation_tokens": "activated LoRA (the adapter applies only after its invocation "
                               "tokens)",
    "arrow_config": "Arrow routing over several LoRA experts",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
    "kasa_config": "KaSA (singular-value adaptation beside the LoRA term)",
    "use_qalora": "QA-LoRA (pooled input groups)",
    "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trainable token embeddings beside the LoRA weights",
    "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
    "layer_replication": "layer_replication (a model of repeated base layers)",
}
_MOVES_THE_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")
"""``init_lora_weights`` that train against a changed base weight: unconverted, such an
adapter is only right on that changed base, which the runtime does not have."""
PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha's default, when the config leaves it out
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]  # PEFT's target_modules for model_type llama
PEFT_DEFAULT_R = 8  # LoraConfig.r's default, likewise (the weights' rank must be it)


def load_peft_adapter(path: str | Path, name: str | None = None) -> LoRAAdapter:
    path = Path(path)
    name = name or path.name
    cfg = _read_config(path)
    f = path / CONFIG
    r = cfg.get("r", PEFT_DEFAULT_R)
    if not _is_positive_int(r):
        raise AdapterError(f"{f}: 'r' must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not is_finite_number(alpha):
        raise AdapterError(f"{f}: 'lora_alpha' must be a finite number, got {alpha!r}")
    rank_pattern = _patterns(cfg, "rank_pattern", _is_positive_int, "a positive integer", f)
    alpha_pattern = _patterns(cfg, "alpha_pattern", is_finite_number, "a finite number", f)
    use_rslora = _flag(cfg, "use_rslora", f)
    targets = _targets(cfg, path)
    params = _target_parameters(cfg, path)
    tensors = _read_weights(path)
    pairs: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    base_layers = {}
    seen: dict[tuple, str] = {}  # what a key names -> the key
    for key, t in tensors.items():
        if m := _BASE_KEY.match(key):
            _once(seen, ("base", m.group(1)), key, path)
            base_layers[m.group(1)] = t
            continue
        mk, ab = _parse_key(key, path)
        ab, t = _embedding_layout(key, mk, ab, t)
        _once(seen, (mk, ab), key, path)
        pairs.setdefault(mk, {})[ab] = t
    if not pairs:
        raise AdapterError(f"{path / WEIGHTS}: holds no lora_A/lora_B weights (an empty or "
                           "unfinished save?): save the adapter again with save_pretrained")
    modules = {}
    for mk, ab in sorted(pairs.items(), key=lambda kv: (kv[0][0] or -1, kv[0][1])):
        where = f"{path}: {module_path(*mk)}"
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(f"{where}: lora_{missing} is missing from {WEIGHTS} (a partial "
                               "save?): save the adapter again")
        if targets is not None and mk[1] not in targets:
            raise AdapterError(f"{where}: has weights but target_modules {sorted(targets)} does "
                               f"not name {mk[1]!r}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"{where}: lora_A/lora_B must be 2-D, got {tuple(a.shape)} and "
                               f"{tuple(b.shape)}")
        pattern_name = _pattern_name(mk, params)
        mod_r = _pattern_value(rank_pattern, pattern_name, r)
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: lora_A {tuple(a.shape)} has rank {a.shape[0]} but "
                               f"lora_B {tuple(b.shape)} has rank {b.shape[1]} (a corrupt or "
                               "hand-edited file): save the adapter again")
        if a.shape[0] != mod_r and not _tied_to_embedding(cfg, mk, a, pairs):
            raise AdapterError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} have "
                               f"rank {a.shape[0]}, but {CONFIG} gives this module rank {mod_r}: "
                               "set r, or a rank_pattern entry for it, to the weights' rank")
        mod_alpha = float(_pattern_value(alpha_pattern, pattern_name, alpha))
        scaling = mod_alpha / (math.sqrt(mod_r) if use_rslora else mod_r)
        modules[mk] = ModuleLoRA(a, b, scaling)
    return LoRAAdapter(name, modules, r, float(alpha), use_rslora,
                       tuple(sorted(targets or {t for _, t in modules})),
                       dict(rank_pattern), dict(alpha_pattern), base_layers)


def save_peft_adapter(adapter: LoRAAdapter, path: str | Path,
                      base_model: str | os.PathLike | None = "") -> None:
    """Writes ``adapter`` in PEFT's format so that reading it back, here or with PEFT, gives
    every module the same rank, scaling and weights. The adapter's own r, lora_alpha and
    patterns are written where they give each module its rank and scaling (an adapter read
    from PEFT's files); otherwise r and lora_alpha are the commonest ones and rank_pattern /
    alpha_pattern name each other module by its escaped path (PEFT matches a key as a regex
    against the end of a module's name). target_modules lists the targets where each covers
    the same layers 0..n-1, else it is a regex of the exact module paths (PEFT wraps only
    those). Saved base layers (embed_tokens, lm_head) are written as PEFT does."""
    path = Path(path)
    for (layer, target), m in adapter.modules.items():
        where = f"adapter {adapter.name!r}, {module_path(layer, target)}"
        if not (isinstance(m.a, torch.Tensor) and isinstance(m.b, torch.Tensor)
                and m.a.dim() == 2 and m.b.dim() == 2 and m.a.shape[0] == m.b.shape[1] >= 1):
            raise AdapterError(f"{where}: lora_A / lora_B must be 2-D of one rank >= 1 to be "
                               f"saved, got {_shape(m.a)} / {_shape(m.b)}")
        if not is_finite_number(m.scaling):
            raise AdapterError(f"{where}: scaling must be a finite number, got {m.scaling!r}")
    if not adapter.modules:
        raise AdapterError(f"adapter {adapter.name!r} has no LoRA weights to save")
    if not isinstance(base_model, str | os.PathLike | None):
        raise AdapterError(f"save_peft_adapter: base_model must be the base model's name or "
                           f"path (a str or Path), got {base_model!r}")
    r, alpha, rank_pattern, alpha_pattern = _scaling_config(adapter)
    # The config is made before any file is written: one that failed to serialise (a numpy
    # alpha, a Path base_model) had left new weights beside the folder's old config.
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model is None else os.fspath(base_model),
        "r": _plain(r), "lora_alpha": _plain(alpha), "use_rslora": bool(adapter.use_rslora),
        "target_modules": _saved_targets(adapter),
        "rank_pattern": {k: _plain(v) for k, v in rank_pattern.items()},
        "alpha_pattern": {k: _plain(v) for k, v in alpha_pattern.items()},
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
    }
    text = json.dumps(cfg, indent=2) + "\n"
    tensors = {}
    for (layer, target), m in adapter.modules.items():
        tensors[_peft_key(layer, target, "A")] = m.a.contiguous()
        tensors[_peft_key(layer, target, "B")] = m.b.contiguous()
    for target, t in adapter.base_layers.items():
        tensors[f"base_model.model.{module_path(None, target)}.base_layer.weight"] = (
            t.contiguous())
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS))
    (path / CONFIG).write_text(text)


def _shape(t) -> tuple | str:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _plain(x: float) -> float:
    """``x`` as the Python int or float JSON writes (a numpy scalar is neither)."""
    return int(x) if is_int(x) else float(x)


def _scaling_config(adapter: LoRAAdapter) -> tuple[int, float, dict, dict]:
    """(r, lora_alpha, rank_pattern, alpha_pattern) that give each module of ``adapter`` its
    rank and, exactly, its scaling, as ``load_peft_adapter`` (and PEFT) compute them."""
    mods = {module_path(*k): m for k, m in sorted(adapter.modules.items(), key=_module_order)}
    rslora = adapter.use_rslora

    def scaling(alpha, rank: int) -> float:
        return float(alpha) / (math.sqrt(rank) if rslora else rank)

    try:
        own = (_is_positive_int(adapter.r) and is_finite_number(adapter.alpha)
               and all(map(_is_positive_int, adapter.rank_pattern.values()))
               and all(map(is_finite_number, adapter.alpha_pattern.values())) and all(
            _pattern_value(adapter.rank_pattern, p, adapter.r) == m.rank
            and scaling(_pattern_value(adapter.alpha_pattern, p, adapter.alpha), m.rank)
            == float(m.scaling) for p, m in mods.items()))
    except (re.error, TypeError, AttributeError):
        own = False  # patterns that are not dicts of regexes
    if own:
        return adapter.r, adapter.alpha, dict(adapter.rank_pattern), dict(adapter.alpha_pattern)
    prefer = float(adapter.alpha) if is_finite_number(adapter.alpha) else None
    alphas = {p: _alpha_for(float(m.scaling), m.rank, rslora, prefer) for p, m in mods.items()}
    r = _commonest([m.rank for m in mods.values()],
                   adapter.r if _is_positive_int(adapter.r) else None)
    alpha = _commonest(list(alphas.values()), prefer)
    return (r, alpha, {re.escape(p): m.rank for p, m in mods.items() if m.rank != r},
            {re.escape(p): a for p, a in alphas.items() if a != alpha})


def _alpha_for(s: float, rank: int, rslora: bool, prefer: float | None) -> float:
    """An alpha for which PEFT's ``alpha / d`` (``d``: the rank, or its root under rsLoRA)
    is ``s``: ``prefer`` if it is one, else ``s * d``, which divides back to ``s`` for every
    ``s`` of that form. A scaling no float alpha gives (0.1 at rank 3: 0.3 / 3 and its
    neighbour both miss it) comes back as the nearest one PEFT can express, within an ulp."""
    d = math.sqrt(rank) if rslora else rank
    if prefer is not None and prefer / d == s:
        return prefer
    return s * d


def _commonest(values: list, prefer):
    counts = Counter(values)
    top = max(counts.values())
    if counts.get(prefer) == top:
        return prefer
    return min(v for v, c in counts.items() if c == top)


def _saved_targets(adapter: LoRAAdapter) -> list[str] | str:
    layers: dict[str, set[int]] = {}
    for layer, target in adapter.modules:
        if layer is not None:
            layers.setdefault(target, set()).add(layer)
    n = max((max(s) for s in layers.values()), default=-1) + 1
    if all(s == set(range(n)) for s in layers.values()):
        return sorted(adapter.targets)
    paths = sorted(module_path(*k) for k in adapter.modules)
    return "(" + "|".join(re.escape(p) for p in paths) + ")"


def _module_order(item) -> tuple:
    (layer, target), _ = item
    return (-1 if layer is None else layer, target)


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory (expected a PEFT adapter "
                           f"folder with {CONFIG} and {WEIGHTS})")
    f = path / CONFIG
    if not f.is_file():
        raise AdapterError(f"{f} is missing: not a PEFT adapter folder{_subfolder_hint(path)}")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{f}: peft_type {cfg['peft_type']!r} is not LORA")
    if _flag(cfg, "use_dora", f):
        raise AdapterError(f"{f}: DoRA adapters are not supported (use_dora=True): "
                           f"{_MERGE_FIX}, or retrain it with use_dora=false")
    for key in _IGNORED_FLAGS:
        _flag(cfg, key, f)
    for key, what in _CHANGES_THE_FORWARD.items():
        if cfg.get(key):
            raise AdapterError(f"{f}: {key}={cfg[key]!r}: {what} is not supported; this "
                               f"runtime serves plain LoRA: retrain the adapter without {key}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_MOVES_THE_BASE):
        raise AdapterError(f"{f}: init_lora_weights={init!r} trains against a changed base "
                           "weight, which this runtime does not serve: save the adapter with "
                           "PEFT's save_pretrained(..., path_initial_model_for_weight_"
                           "conversion=...) to convert it into a LoRA of the original base")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{f}: modules_to_save={cfg['modules_to_save']} is not supported "
                           f"(fully trained modules are not LoRA): {_MERGE_FIX}, or retrain "
                           "with those modules in target_modules instead")
    return cfg


def _subfolder_hint(path: Path) -> str:
    """PEFT's save_pretrained puts an adapter not named "default" in a subfolder of its name."""
    subs = sorted(d.name for d in path.iterdir() if (d / CONFIG).is_file())
    if not subs:
        return ""
    return (f" (it holds PEFT adapters in subfolders {subs}, as save_pretrained writes adapters "
            f"not named 'default': pass one of them, e.g. {path / subs[0]})")


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


def _targets(cfg: dict, path: Path) -> set[str] | None:
    """The PEFT target names the config allows; None for a regex (weights decide). Names of
    other architectures' modules in the list are ignored, as PEFT does (one must match);
    ``target_parameters`` adds the modules of the parameters it names; with
    ``ensure_weight_tying`` embed_tokens and lm_head stand for each other. Without
    target_modules (absent or null) PEFT targets its default for Llama, q_proj and v_proj."""
    raw = cfg.get("target_modules")
    params = _target_parameters(cfg, path)
    names = _target_names(PEFT_DEFAULT_TARGETS if raw is None else raw or [], path)
    if names is None:
        return None
    for p in params:
        leaf = p.removesuffix(".weight").rsplit(".", 1)[-1]
        if leaf not in BY_NAME:
            raise AdapterError(f"{path / CONFIG}: target_parameters names {p!r}; supported: "
                               "the weight of " + ", ".join(sorted(BY_NAME)))
        names.add(leaf)
    if cfg.get("ensure_weight_tying") and names & {"embed_tokens", "lm_head"}:
        names |= {"embed_tokens", "lm_head"}
    return names


def _target_parameters(cfg: dict, path: Path) -> list[str]:
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list) or not all(isinstance(t, str) for t in params):
        raise AdapterError(f"{path / CONFIG}: target_parameters must be a list of parameter "
                           f"names, got {params!r}")
    return params


def _pattern_name(mk: ModuleKey, params: list[str]) -> str:
    """The name PEFT matches rank_pattern / alpha_pattern keys against: the module's path, or
    for a module whose weight ``target_parameters`` names, the parameter's
    (``model.layers.0.mlp.up_proj.weight``, which a key ``up_proj`` does not match)."""
    path = module_path(*mk)
    param = f"{path}.weight"
    if any(param == p or param.endswith(f".{p}") for p in params):
        return param
    return path


def _target_names(raw, path: Path) -> set[str] | None:
    if raw == "all-linear":
        return set(LINEAR_TARGETS)
    if isinstance(raw, str):
        try:
            re.compile(raw)
        except re.error as e:
            raise AdapterError(f"{path / CONFIG}: target_modules {raw!r} is not a valid "
                               f"regex: {e}") from e
        return None
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise AdapterError(f"{path / CONFIG}: target_modules must be a list of module names "
                           f"(or a regex string, or 'all-linear'), got {raw!r}")
    names = {t.rsplit(".", 1)[-1] for t in raw} & set(BY_NAME)
    if raw and not names:
        raise AdapterError(f"{path / CONFIG}: target_modules {raw!r} names no module of a "
                           f"Llama model; supported: {sorted(BY_NAME)}")
    return names


def _parse_key(key: str, path: Path) -> tuple[ModuleKey, str]:
    m = _LAYER_KEY.match(key)
    if m:
        layer, block, target, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if target not in BY_NAME:
            raise AdapterError(f"{path / WEIGHTS}: key {key!r} targets unknown module "
                               f"{target!r}; supported: {sorted(BY_NAME)}")
        home = BY_NAME[target].block
        if home != block:
            where = "at model level" if home is None else f"in each layer's {home}"
            right = _peft_key(None if home is None else layer, target, ab)
            raise AdapterError(f"{path / WEIGHTS}: key {key!r} puts {target} in layer {layer}'s "
                               f"{block}, but {target} sits {where}; expected {right!r}")
        return (layer, target), ab
    m = _TOP_KEY.match(key)
    if m:
        return (None, m.group(1)), m.group(3)
    if key.endswith(".bias"):
        raise AdapterError(f"{path / WEIGHTS}: key {key!r} is a bias; LoRA biases are not "
                           "supported (retrain with bias='none' and lora_bias=False)")
    raise AdapterError(f"{path / WEIGHTS}: unrecognised key {key!r} (not a LoRA weight of a "
                       "Llama module)")


def _tied_to_embedding(cfg: dict, mk: ModuleKey, a: torch.Tensor, pairs: dict) -> bool:
    """Whether ``mk`` is lm_head holding the embedding's LoRA, as PEFT ties it under
    ``ensure_weight_tying`` (lora_A = B_emb^T: the embedding's rank) while scaling it by
    lm_head's own configured rank (a rank_pattern on one of the pair makes them differ)."""
    emb = pairs.get((None, "embed_tokens"), {}).get("A")
    return (bool(cfg.get("ensure_weight_tying")) and mk == (None, "lm_head")
            and emb is not None and emb.dim() == 2 and a.shape[0] == emb.shape[0])


def _embedding_layout(key: str, mk: ModuleKey, ab: str, t: torch.Tensor
                      ) -> tuple[str, torch.Tensor]:
    """``(ab, t)`` in PEFT's embedding layout (lora_embedding_A [r, vocab], lora_embedding_B
    [hidden, r]). An embed_tokens weight targeted through ``target_parameters`` is saved as
    ``lora_A.weight`` [r, hidden] and ``lora_B.weight`` [vocab, r], a delta ``B @ A`` on the
    [vocab, hidden] weight: the same term with A and B swapped and transposed."""
    if mk != (None, "embed_tokens") or _TOP_KEY.match(key).group(2):
        return ab, t
    return {"A": "B", "B": "A"}[ab], t.t() if t.dim() == 2 else t


def _once(seen: dict, what, key: str, path: Path) -> None:
    """Two keys naming one tensor (with and without a prefix or ``.default``): which one
    is meant is not known."""
    if what in seen:
        raise AdapterError(f"{path / WEIGHTS}: keys {seen[what]!r} and {key!r} name the same "
                           "tensor; keep one of them")
    seen[what] = key


def _peft_key(layer: int | None, target: str, ab: str) -> str:
    prefix = f"base_model.model.{module_path(layer, target)}"
    if target == "embed_tokens":
        return f"{prefix}.lora_embedding_{ab}"
    return f"{prefix}.lora_{ab}.weight"


def _is_positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _flag(cfg: dict, key: str, f: Path) -> bool:
    value = cfg.get(key)
    if value is None:  # absent or null: off, as PEFT reads it
        return False
    if not isinstance(value, bool):
        raise AdapterError(f"{f}: {key!r} must be true or false, got {value!r}")
    return value


def _patterns(cfg: dict, key: str, valid, what: str, f: Path) -> dict:
    """``cfg[key]``: module-name regexes to values, each checked the way it will be used."""
    raw = cfg.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise AdapterError(f"{f}: {key!r} must be an object of module regex -> value, got "
                           f"{raw!r}")
    for pat, value in raw.items():
        try:
            _pattern_regex(pat)
        except re.error as e:
            raise AdapterError(f"{f}: {key} key {pat!r} is not a valid regex: {e}") from e
        if not valid(value):
            raise AdapterError(f"{f}: {key}[{pat!r}] must be {what}, got {value!r}")
    return raw


def _pattern_regex(pat: str) -> re.Pattern:
    return re.compile(rf"(.*\.)?({pat})$")


def _pattern_value(patterns: dict, module: str, default):
    for pat, value in patterns.items():
        if _pattern_regex(pat).match(module):
            return value
    return default
