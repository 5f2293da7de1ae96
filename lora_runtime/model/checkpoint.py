"""Loading Hugging Face Llama checkpoints (``config.json`` + safetensors, sharded or not)
into this runtime's fused layout (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.llama import LlamaForCausalLM, check_dtype
from lora_runtime.model.modules import TARGETS

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_FUSED = {t.name: (f"{t.block}.{t.module}", t.slice) for t in TARGETS if t.name != t.module}
_FUSED_NAMES = {fused.split(".")[1] for fused, _ in _FUSED.values()}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_NUMBERED_SHARD = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


class CheckpointError(ValueError):
    pass


def load_hf_llama(path: str | Path, dtype: torch.dtype, device) -> LlamaForCausalLM:
    check_dtype(dtype)  # before reading the folder
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing: not a Hugging Face checkpoint folder")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    config = LlamaConfig.from_hf(raw)
    model = LlamaForCausalLM.empty(config, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _hf_names(config)
    filled: dict[str, str] = {}  # tensor name -> the file that held it
    tied_head = None
    for file in _weight_files(path):
        with _open(file) as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if _IGNORED.search(key):
                    continue
                if key in filled:
                    raise CheckpointError(f"{file.name}: tensor {key!r} is also in "
                                          f"{filled[key]}: which one is meant is not known")
                if key not in expected:  # this runtime's fused names included
                    raise CheckpointError(f"{file.name}: unexpected tensor {key!r} "
                                          f"({_why_unexpected(key, config)})")
                target, rows = _destination(key, config)
                dest = params[target].data if rows is None else params[target].data[rows]
                t = f.get_tensor(key)
                if not t.is_floating_point():  # a cast would serve its integers as weights
                    raise CheckpointError(f"{file.name}: {key} has dtype {t.dtype}; weights must "
                                          "be floating point (dequantize the checkpoint)")
                if tuple(t.shape) != tuple(dest.shape):
                    raise CheckpointError(f"{file.name}: {key} has shape {tuple(t.shape)}, "
                                          f"expected {tuple(dest.shape)} from config.json")
                if key == "lm_head.weight" and config.tie_word_embeddings:
                    # Shares the embedding's tensor: a copy would overwrite the embedding.
                    tied_head, filled[key] = t, file.name
                    continue
                cast = t.to(dtype)
                if _narrows(t.dtype, dtype) and not torch.isfinite(cast).all():
                    why = ("holds NaN or Inf" if not torch.isfinite(t).all() else
                           f"holds values beyond {dtype}'s range")
                    raise CheckpointError(f"{file.name}: {key} {why}: load the checkpoint in "
                                          "a wider dtype (e.g. bfloat16) or fix the tensor")
                dest.copy_(cast)
                filled[key] = file.name
    _check_complete(set(filled), config)
    if tied_head is not None and not torch.equal(tied_head.to(dtype).to(device),
                                                 model.model.embed_tokens.weight.data):
        raise CheckpointError("config.json ties lm_head to embed_tokens "
                              "(tie_word_embeddings: true) but the checkpoint's lm_head.weight "
                              "differs from its embed_tokens.weight: set tie_word_embeddings to "
                              "false to serve the checkpoint's lm_head")
    return model


def _narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` to ``dst`` can overflow (then the cast is checked: a pass over
    the tensor, paid only by such loads, e.g. a float32 checkpoint served in float16)."""
    return (src.is_floating_point and dst.is_floating_point
            and torch.finfo(dst).max < torch.finfo(src).max)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a JSON object: {e}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(n, str) for n in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor name -> shard file")
        files = [path / n for n in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path} (PyTorch .bin checkpoints are not "
                              "read: convert them to safetensors)")
    _check_numbered_shards(path, files)
    return files


def _check_numbered_shards(path: Path, files: list[Path]) -> None:
    """Shards named ``model-00001-of-00004.safetensors`` without their index: one missing
    would otherwise read as a checkpoint of fewer layers (and be told to set
    num_hidden_layers to them, a truncated model)."""
    series = {(m.group(1), len(m.group(2)), m.group(3)) for f in files
              if (m := _NUMBERED_SHARD.fullmatch(f.name))}
    for prefix, width, total in series:
        missing = [name for i in range(1, int(total) + 1)
                   if not (path / (name := f"{prefix}-{i:0{width}d}-of-{total}.safetensors"))
                   .is_file()]
        if missing:
            raise CheckpointError(f"{path} lacks shards {missing} of its {int(total)} (and "
                                  "model.safetensors.index.json): download them again")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} could not be read (corrupt safetensors?): {e}") from None


def _destination(key: str, config: LlamaConfig) -> tuple[str, slice | None]:
    m = _LAYER_KEY.match(key)
    if m and m.group(3) in _FUSED:  # a Hugging Face name (checked), so under its own block
        fused, s = _FUSED[m.group(3)]
        bounds = config.module_shape(fused.split(".")[1]).slice_widths
        lo = sum(bounds[:s])
        return f"model.layers.{m.group(1)}.{fused}.weight", slice(lo, lo + bounds[s])
    return key, None


def _hf_names(config: LlamaConfig) -> set[str]:
    """The tensors of a Hugging Face checkpoint of ``config``'s model (lm_head's even where
    it is tied: such a checkpoint may hold it)."""
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        want |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        want |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        want |= {f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return want


def _why_unexpected(key: str, config: LlamaConfig) -> str:
    m = _LAYER_KEY.match(key)
    if m and m.group(3) in _FUSED_NAMES:
        parts = [n for n, (fused, _) in _FUSED.items() if fused.endswith(f".{m.group(3)}")]
        return (f"this runtime's fused name, not a Hugging Face one: a checkpoint holds "
                f"{', '.join(parts)} apart")
    if m and int(m.group(1)) >= config.num_layers:
        return (f"layer {m.group(1)}; config.json's num_hidden_layers is {config.num_layers}: "
                "set it to the checkpoint's layer count")
    return "not part of a Llama model"


def _check_complete(filled: set[str], config: LlamaConfig) -> None:
    want = _hf_names(config)
    if config.tie_word_embeddings:
        want.discard("lm_head.weight")
    missing = sorted(want - filled)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}: "
                              f"{_why_missing(missing, filled, config)}")


def _why_missing(missing: list[str], filled: set[str], config: LlamaConfig) -> str:
    if missing == ["lm_head.weight"]:
        return ("config.json's tie_word_embeddings is false: set it to true if the checkpoint's "
                "lm_head shares embed_tokens' weights")
    held = {int(m.group(1)) for k in filled if (m := _LAYER_INDEX.match(k))}
    layers = max(held, default=-1) + 1
    if 0 < layers < config.num_layers and all(
            (m := _LAYER_INDEX.match(k)) and int(m.group(1)) >= layers for k in missing):
        return (f"it holds layers 0..{layers - 1}; config.json's num_hidden_layers is "
                f"{config.num_layers}: set it to {layers}")
    return "the checkpoint is incomplete (a shard missing?): download it again"
