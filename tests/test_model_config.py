"""Configurations and caches the model cannot serve are refused where they are given, naming
the field and the fix: another architecture's config.json, rope settings the rotary table
cannot apply, non-positive sizes and constants, explicit nulls, a checkpoint tensor beyond the
load dtype's range, and a KV cache built for another model."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint_errors import CONFIG, _tensors, _write

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama
from lora_runtime.model.config import LlamaConfig, tiny
from lora_runtime.model.llama import LlamaForCausalLM

HF = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}


@pytest.mark.parametrize("extra, says", [
    ({"model_type": "mistral"}, "not a Llama checkpoint"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "not a Llama checkpoint"),
    ({"model_type": "llama", "architectures": ["MistralForCausalLM"]}, "not a Llama"),
    ({"model_type": "llama", "sliding_window": 16}, "sliding_window=16"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' is not supported"),
    ({"rope_theta": 0}, "rope_theta must be a positive"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive"),
    ({"head_dim": -8}, "head_dim must be a positive"),
    ({"head_dim": 0}, "head_dim must be a positive"),  # 0 was taken as null (derived)
    ({"num_key_value_heads": 0}, "num_kv_heads must be a positive"),  # 0 was taken as null
    ({"head_dim": True}, "head_dim must be a positive integer"),  # passed as head_dim 1
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),  # a TypeError
    ({"num_attention_heads": 4.0}, "num_heads must be a positive integer"),
    # Loaded its packed integers or scales as if they were the weights, or refused naming a
    # tensor of the quantization.
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method='bitsandbytes'"),
    # Two rope_theta: transformers v5 reads the rope dict's, v4 the top-level one (served).
    ({"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_theta=500000.0 and 10000.0"),
])
def test_a_config_the_model_cannot_serve_is_refused(extra, says):
    with pytest.raises(ValueError, match=says):
        LlamaConfig.from_hf(HF | extra)


def test_explicit_nulls_take_the_defaults():
    cfg = LlamaConfig.from_hf(HF | {"rope_theta": None, "rms_norm_eps": None,
                                     "max_position_embeddings": None, "sliding_window": None,
                                     "rope_scaling": {"rope_type": "default"},
                                     "head_dim": None, "num_key_value_heads": None})
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings,
            cfg.rope_scaling) == (10000.0, 1e-6, 4096, None)
    assert (cfg.head_dim, cfg.num_kv_heads) == (HF["hidden_size"] // HF["num_attention_heads"],
                                                HF["num_attention_heads"])
    assert LlamaConfig.from_hf(HF).num_kv_heads == 1  # no model_type, no architectures: fine
    for act in (None, "silu", "swish"):  # transformers' ACT2FN maps swish to SiLU too
        assert LlamaConfig.from_hf(HF | {"hidden_act": act}) == LlamaConfig.from_hf(HF)
    v5 = HF | {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert LlamaConfig.from_hf(v5).rope_theta == 5e5


@pytest.mark.parametrize("scaling, says", [
    ({"rope_type": "linear", "factor": 2.0}, "'linear' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks"),
    ("llama3", "must be a dict"),
])
def test_a_config_built_directly_checks_its_rope_scaling(scaling, says):
    with pytest.raises(ValueError, match=says):
        dataclasses.replace(tiny(), rope_scaling=scaling)
    assert dataclasses.replace(tiny(), rope_scaling={"rope_type": "default"}).rope_scaling is None


@pytest.mark.parametrize("change, says", [
    (dict(head_dim=-2), "head_dim must be a positive integer"),
    (dict(head_dim=3), "positive and even for rotary embeddings, got 3"),
    (dict(head_dim=0, num_heads=4, hidden_size=36), "positive and even .* got 9"),
    (dict(head_dim=0, num_heads=4, hidden_size=30), "hidden_size must divide by num_heads"),
    (dict(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads=3"),
])
def test_head_shapes_attention_cannot_serve_are_refused(change, says):
    with pytest.raises(ValueError, match=says):
        dataclasses.replace(tiny(), **change)
    assert dataclasses.replace(tiny(), head_dim=0, hidden_size=32).head_dim == 8  # 32 / 4 heads


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}


@pytest.mark.parametrize("extra, says", [
    # A factor of 0 built a NaN rotary table (every logit NaN, silently); the rest raised a
    # TypeError or ZeroDivisionError from the rotary code, naming no field.
    ({"rope_scaling": L3 | {"factor": 0}}, "factor=0"),
    ({"rope_scaling": L3 | {"factor": -2.0}}, "factor=-2.0"),
    ({"rope_scaling": L3 | {"factor": "8"}}, "factor='8'"),
    ({"rope_scaling": L3 | {"low_freq_factor": 0}}, "low_freq_factor=0"),
    ({"rope_scaling": L3 | {"original_max_position_embeddings": None}},
     "original_max_position_embeddings=None"),
    ({"rope_scaling": L3 | {"original_max_position_embeddings": 64.5}},
     "original_max_position_embeddings=64.5"),
    ({"rope_scaling": L3 | {"low_freq_factor": 4.0}}, "high_freq_factor 4.0 must exceed"),
    ({"rope_theta": True}, "rope_theta must be a positive"),  # read as 1.0
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),  # tied
])
def test_rope_scaling_values_and_flags_are_checked(extra, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        LlamaConfig.from_hf(HF | extra)
    assert LlamaConfig.from_hf(HF | {"rope_scaling": L3}).rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads"])
def test_a_config_without_a_required_field_names_it(field):
    """It raised a bare KeyError: 'vocab_size'."""
    with pytest.raises(ValueError, match=f"config.json has no {field!r}"):
        LlamaConfig.from_hf({k: v for k, v in HF.items() if k != field})


@pytest.mark.parametrize("text, says", [
    ("[]", "config.json must hold a JSON object"),  # an AttributeError before
    ('{"vocab_size": 32,', "config.json is not valid JSON"),  # a JSONDecodeError, no path
])
def test_a_config_file_that_is_not_an_object_is_refused(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=says):
        load_hf_llama(tmp_path, torch.float32, "cpu")


def test_a_tensor_beyond_the_load_dtype_s_range_is_refused(tmp_path):
    """Checked where the cast narrows (float32 on disk, float16 or bfloat16 served)."""
    t = _tensors(tied=False)
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = 1e6
    _write(tmp_path / "big", [t])
    assert load_hf_llama(tmp_path / "big", torch.float32, "cpu") is not None
    with pytest.raises(CheckpointError, match="up_proj.weight holds values beyond"):
        load_hf_llama(tmp_path / "big", torch.float16, "cpu")
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    (tmp_path / "big" / "model-0.safetensors").unlink()
    save_file(t, str(tmp_path / "big" / "model-0.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight holds NaN"):
        load_hf_llama(tmp_path / "big", torch.bfloat16, "cpu")


@pytest.mark.parametrize("cache", [
    dict(config=tiny(1)), dict(dtype=torch.float16),
    dict(config=dataclasses.replace(tiny(2), head_dim=32)),
    dict(config=dataclasses.replace(tiny(2), num_kv_heads=4)),
])
def test_a_kv_cache_built_for_another_model_is_refused(cache):
    model = LlamaForCausalLM.random(tiny(2), torch.float32, "cpu", seed=0)
    args = dict(config=tiny(2), max_tokens=16, dtype=torch.float32, device="cpu") | cache
    with pytest.raises(ValueError, match="the KV cache holds.*the model needs"):
        ModelRunner(model, KVCache(**args), None)
    ModelRunner(model, KVCache(tiny(2), 16, torch.float32, "cpu"), None)
