"""A Hugging Face checkpoint the loader cannot serve as written is refused with the reason,
never loaded into wrong weights: a tensor held by two shards, a tied lm_head that differs
from the embedding it would overwrite, an incomplete llama3 rope config; and a PEFT adapter
over replicated layers. Checkpoints written by hand (no transformers needed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lora_runtime.lora.adapters import (
    AdapterError,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama
from lora_runtime.model.config import tiny

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
          "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}


def _tensors(tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32, 16), "model.norm.weight": (16,),
              "model.layers.0.input_layernorm.weight": (16,),
              "model.layers.0.post_attention_layernorm.weight": (16,),
              "model.layers.0.self_attn.q_proj.weight": (16, 16),
              "model.layers.0.self_attn.k_proj.weight": (8, 16),
              "model.layers.0.self_attn.v_proj.weight": (8, 16),
              "model.layers.0.self_attn.o_proj.weight": (16, 16),
              "model.layers.0.mlp.gate_proj.weight": (32, 16),
              "model.layers.0.mlp.up_proj.weight": (32, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 32)}
    out = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    if not tied:
        out["lm_head.weight"] = torch.randn(32, 16, generator=g)
    return out


def _write(path, shards: list[dict], **config) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG | config))
    for i, tensors in enumerate(shards):
        save_file(tensors, str(path / f"model-{i}.safetensors"))


def test_a_plain_checkpoint_loads(tmp_path):
    t = _tensors(tied=False)
    _write(tmp_path / "ok", [t])
    model = load_hf_llama(tmp_path / "ok", torch.float32, "cpu")
    assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, t["lm_head.weight"])


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int8, None])
def test_a_dtype_that_is_not_a_floating_torch_dtype_is_refused(tmp_path, dtype):
    """"bfloat16" raised 'Invalid device string', None an AttributeError."""
    _write(tmp_path / "ok", [_tensors(tied=False)])
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_hf_llama(tmp_path / "ok", dtype, "cpu")


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    t = _tensors(tied=False)
    _write(tmp_path / "dup", [t, {"model.norm.weight": torch.zeros(16)}])
    with pytest.raises(CheckpointError, match="'model.norm.weight' is also in model-0"):
        load_hf_llama(tmp_path / "dup", torch.float32, "cpu")


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_lm_head_never_overwrites_the_embedding(tmp_path, same):
    t = _tensors(tied=True)
    head = t["model.embed_tokens.weight"].clone() if same else torch.randn(32, 16)
    # The head in a later shard than the embedding: a copy into the shared tensor would win.
    _write(tmp_path / "tied", [t, {"lm_head.weight": head}], tie_word_embeddings=True)
    if same:
        model = load_hf_llama(tmp_path / "tied", torch.float32, "cpu")
        assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"])
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        with pytest.raises(CheckpointError, match="set tie_word_embeddings to false"):
            load_hf_llama(tmp_path / "tied", torch.float32, "cpu")


def test_an_incomplete_llama3_rope_config_names_the_keys(tmp_path):
    _write(tmp_path / "rope", [_tensors(tied=False)],
           rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="llama3 rope scaling lacks.*low_freq_factor"):
        load_hf_llama(tmp_path / "rope", torch.float32, "cpu")


def test_a_peft_adapter_over_replicated_layers_is_refused(tmp_path):
    save_peft_adapter(random_adapter(tiny(), "x", 4, seed=1), tmp_path / "x")
    cfg_file = tmp_path / "x" / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text())
                                   | {"layer_replication": [[0, 1], [0, 1]]}))
    with pytest.raises(AdapterError, match="layer_replication"):
        load_peft_adapter(tmp_path / "x")


def _break_int8(path):
    t = _tensors(tied=False)
    t["model.layers.0.mlp.down_proj.weight"] = torch.ones(16, 32, dtype=torch.int8)
    save_file(t, str(path / "model-0.safetensors"))


@pytest.mark.parametrize("fault, says", [
    # An integer (quantized) tensor was cast and served as weights of its integer values.
    (_break_int8, "down_proj.weight has dtype torch.int8; weights must be floating point"),
    # The index and shard faults raised a bare JSONDecodeError, KeyError or
    # SafetensorError naming no file.
    (lambda p: (p / "model.safetensors.index.json").write_text("{"),
     "model.safetensors.index.json is not a JSON object"),
    (lambda p: (p / "model.safetensors.index.json").write_text("{}"), "has no weight_map"),
    (lambda p: (p / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-1.safetensors"}})),
     r"names shards that are not in .*\['model-1.safetensors'\]"),
    (lambda p: (p / "model-0.safetensors").write_bytes(b"garbage"),
     "model-0.safetensors could not be read"),
])
def test_a_checkpoint_it_cannot_read_as_weights_is_refused_naming_the_file(tmp_path, fault,
                                                                            says):
    _write(tmp_path / "ck", [_tensors(tied=False)])
    fault(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=says):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path):
    """The index names the shards read (a stray shard beside them is not); rotary tables
    that older checkpoints saved are skipped."""
    t = _tensors(tied=False)
    names = sorted(t)
    shards = [{k: t[k] for k in names[:5]}, {k: t[k] for k in names[5:]}
              | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}]
    _write(tmp_path / "ck", shards)
    save_file({"model.norm.weight": torch.zeros(16)}, str(tmp_path / "ck" / "stray.safetensors"))
    index = {"weight_map": {k: f"model-{int(k not in shards[0])}.safetensors" for k in names}}
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_hf_llama(tmp_path / "ck", torch.float32, "cpu")
    assert torch.equal(model.model.norm.weight, t["model.norm.weight"])
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[16:24], t["model.layers.0.self_attn.k_proj.weight"])


@pytest.mark.parametrize("change, says", [
    (lambda t: t.pop("model.layers.0.mlp.down_proj.weight"),
     r"lacks 1 tensors, e.g. \['model.layers.0.mlp.down_proj.weight'\]"),
    (lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.ones(32, 16)}),
     "unexpected tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 16)}),
     r"k_proj.weight has shape \(16, 16\), expected \(8, 16\) from config.json"),
    (lambda t: t.clear(), r"no \*.safetensors in"),
])
def test_a_checkpoint_that_is_not_the_configs_model_is_refused(tmp_path, change, says):
    """A missing tensor would leave random weights, another layer's or shape would load
    into the wrong rows."""
    t = _tensors(tied=False)
    change(t)
    _write(tmp_path / "ck", [t] if t else [])
    with pytest.raises(CheckpointError, match=says):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_hf_llama(tmp_path, torch.float32, "cpu")
