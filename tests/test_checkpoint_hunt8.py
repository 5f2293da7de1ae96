"""Hugging Face checkpoints and PEFT adapters, eighth hunt. Real checkpoints that transformers
saved (GQA ratios, head_dim apart from hidden / heads, tied embeddings, llama3 rope, sharded
fp16 / bf16 weights) and adapters that peft saved (patterns, rsLoRA, embedding and lm_head
LoRA) give their logits here; a load dtype the model cannot compute in, a tensor under this
runtime's fused name, and a layer beyond config.json's count are refused naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from test_checkpoint_errors import _tensors, _write

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama
from lora_runtime.model.modules import BY_NAME

CPU = torch.device("cpu")
PROMPTS = [[3, 17, 99, 5], list(range(20, 60))]


# -- load dtypes ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_load_dtype_is_refused_naming_the_served_ones(tmp_path, dtype):
    """e4m3 raised NotImplementedError '"isfinite" not implemented for Float8_e4m3fn' from the
    range check; e5m2 loaded, and its first forward raised '"neg_cpu" not implemented'."""
    _write(tmp_path / "ck", [_tensors(tied=False)])
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype the model "
                                        r"computes in \(.*torch.bfloat16.*\), got torch.float8"):
        load_hf_llama(tmp_path / "ck", dtype, "cpu")
    load_hf_llama(tmp_path / "ck", torch.float64, "cpu")  # the float64 reference still loads


# -- tensors the config's model does not have -----------------------------------------------

@pytest.mark.parametrize("fused, rows", [("self_attn.qkv_proj", 32), ("mlp.gate_up_proj", 64)])
def test_a_tensor_under_the_runtime_s_fused_name_is_refused(tmp_path, fused, rows):
    """``model.layers.0.self_attn.qkv_proj.weight`` is this runtime's name, not a Hugging Face
    one: it was loaded into the fused weight, over (or under, by key order) the q/k/v rows the
    checkpoint's own tensors filled, silently."""
    t = _tensors(tied=False)
    t[f"model.layers.0.{fused}.weight"] = torch.full((rows, 16), 7.0)
    _write(tmp_path / "ck", [t])
    with pytest.raises(CheckpointError, match=rf"unexpected tensor 'model\.layers\.0\.{fused}"
                                              r"\.weight' \(this runtime's fused name"):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


def test_a_layer_beyond_the_configs_count_names_num_hidden_layers(tmp_path):
    """A checkpoint of more layers than config.json says (num_hidden_layers lowered to try a
    few layers) was refused as 'not part of a Llama model'."""
    t = _tensors(tied=False)
    t["model.layers.1.mlp.up_proj.weight"] = torch.ones(32, 16)
    _write(tmp_path / "ck", [t])
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.up_proj"
                                              r"\.weight' \(layer 1; config\.json's "
                                              r"num_hidden_layers is 1"):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


# -- transformers and peft themselves (guards; these held) ----------------------------------

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASES = {
    "gqa3 head_dim 16": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16),
    "mqa head_dim 24, tied": dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
    "llama3 rope, eps 0.1": dict(rms_norm_eps=0.1, rope_theta=500.0, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500.0}),
}
ADAPTER = dict(r=4, lora_alpha=8, use_rslora=True,
               target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"],
               rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"down_proj": 3})


def _hf(dtype, **kw):
    cfg = dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attn_implementation="eager") | kw
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.to(dtype)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("base", list(BASES))
def test_transformers_checkpoints_and_peft_adapters_give_their_logits(tmp_path, base, dtype):
    """Sharded with an index, saved in ``dtype``, served in float32 (transformers in float32
    on the same weights; its rotary table from them, not from a bf16-cast buffer)."""
    hf = _hf(dtype, **BASES[base])
    hf.save_pretrained(tmp_path / "base", max_shard_size="40KB")
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()
    hf = _hf(torch.float32, **BASES[base])
    with torch.no_grad():  # the float32 twin of the saved weights
        for p, q in zip(hf.parameters(), _hf(dtype, **BASES[base]).parameters(), strict=True):
            p.copy_(q.float())
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**ADAPTER)).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(tmp_path / "a")
    model = load_hf_llama(tmp_path / "base", torch.float32, CPU)
    lora = LoRAManager(model, LoRAConfig(1, 4, tuple(BY_NAME), "torch"))
    lora.load_adapter("a", tmp_path / "a")
    runner = ModelRunner(model, KVCache(model.config, 64, torch.float32, CPU), lora)
    for name, ref in ((None, hf), ("a", pm)):
        reqs = [Request(p, name, 1) for p in PROMPTS]
        got = runner.forward_eager(build_extend(reqs, runner.kv, CPU))
        release(reqs, runner.kv)
        with torch.no_grad():
            want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"adapter {name}")
