"""Adapters and checkpoints, thirteenth hunt: PEFT's tied lm_head LoRA (ensure_weight_tying
with a rank_pattern on one of the pair) was refused, naming a fix that scaled it wrong; an
adapter built from trainable parameters kept them alive beside its slot image (its weights
held twice) through the image's autograd graph; a checkpoint missing its last numbered shard
(no index) was told to shrink num_hidden_layers; base_layers=None crashed the save; a numpy
rank was refused by random_adapter as "not an integer"."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch
from peft_parity import assert_serves_peft_logits, save_random_lora
from runtime_helpers import make_runtime
from safetensors.torch import save_file
from test_checkpoint_errors import _tensors, _write

from lora_runtime.lora.adapters import (
    ModuleLoRA,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama
from lora_runtime.model.config import tiny

CPU = torch.device("cpu")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("targets, rank_pattern", [(["embed_tokens"], {"embed_tokens": 2}),
                                                   (["lm_head"], {"lm_head": 2})])
def test_a_tied_lm_head_lora_with_a_rank_pattern_gives_peft_s_logits(tmp_path, targets,
                                                                      rank_pattern):
    """PEFT ties lm_head's LoRA to the embedding's (lora_A = B_emb^T, lora_B = A_emb^T): its
    weights have the embedding's rank while its scaling divides by lm_head's own configured r.
    It was refused ("set r, or a rank_pattern entry for it, to the weights' rank"), a fix that
    would have scaled lm_head by the embedding's rank."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, ensure_weight_tying=True,
        rank_pattern=rank_pattern)).eval()
    save_random_lora(pm, tmp_path / "ad")
    ours = assert_serves_peft_logits(pm, tmp_path / "base", tmp_path / "ad", 4)
    save_peft_adapter(ours.adapters["a"], tmp_path / "again")  # scalings kept, as patterns
    back = load_peft_adapter(tmp_path / "again")
    assert {k: m.scaling for k, m in back.modules.items()} == {
        k: m.scaling for k, m in ours.adapters["a"].modules.items()}


def test_an_adapter_of_trainable_parameters_is_held_once():
    """Weights taken from a model in training (nn.Parameter): the slot image was an autograd
    result of them, so it kept every caller's parameter alive beside its own copy."""
    cfg = tiny(1)
    runner = make_runtime(cfg, dtype=torch.float32, device="cpu", slots=1, max_rank=4)
    drawn = random_adapter(cfg, "x", 4, ("q_proj", "down_proj"))
    params = {k: (torch.nn.Parameter(m.a.clone()), torch.nn.Parameter(m.b.clone()))
              for k, m in drawn.modules.items()}
    drawn.modules = {k: ModuleLoRA(a, b, drawn.modules[k].scaling)
                     for k, (a, b) in params.items()}
    alive = [weakref.ref(p) for pair in params.values() for p in pair]
    runner.lora.load_adapter("x", drawn)
    del drawn, params
    gc.collect()
    assert not any(ref() is not None for ref in alive)
    assert not runner.lora.images["x"].data.requires_grad


def test_a_checkpoint_missing_a_numbered_shard_names_the_shard(tmp_path):
    """Without an index (a download of *.safetensors only) and its second shard absent, it said
    the checkpoint holds layer 0 and to set num_hidden_layers to 1: a wrong, truncated model."""
    t = _tensors(tied=False)
    layer1 = {k.replace("layers.0.", "layers.1."): v for k, v in t.items() if ".layers.0." in k}
    path = tmp_path / "ck"
    _write(path, [], num_hidden_layers=2)
    save_file(t, str(path / "model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks shards \['model-00002-of-00002\."
                                              r"safetensors'\] of its 2.*download them"):
        load_hf_llama(path, torch.float32, "cpu")
    save_file(layer1, str(path / "model-00002-of-00002.safetensors"))
    load_hf_llama(path, torch.float32, "cpu")


def test_an_adapter_without_base_layers_given_as_none_loads_and_saves(tmp_path):
    """base_layers=None, as rank_pattern / alpha_pattern None already were, is no base layer:
    the save raised a bare AttributeError ('NoneType' object has no attribute 'items') and
    the load refused it."""
    cfg = tiny(1)
    ad = dataclasses.replace(random_adapter(cfg, "x", 2, ("q_proj",)), base_layers=None)
    save_peft_adapter(ad, tmp_path / "ad")
    assert load_peft_adapter(tmp_path / "ad").base_layers == {}
    runner = make_runtime(cfg, dtype=torch.float32, device="cpu", slots=1, max_rank=2)
    runner.lora.load_adapter("x", ad)
    assert runner.lora.adapters["x"].base_layers == {}


def test_random_adapter_takes_a_numpy_integer_rank():
    """The LoRAConfig keeps numpy sizes as ints; random_adapter refused np.int64(4) with
    "rank must be an integer >= 1, got np.int64(4)"."""
    cfg = tiny(1)
    ad = random_adapter(cfg, "x", np.int64(4), ("q_proj",))
    assert type(ad.r) is int and ad.modules[(0, "q_proj")].rank == 4
    assert ad.modules[(0, "q_proj")].scaling == random_adapter(
        cfg, "x", 4, ("q_proj",)).modules[(0, "q_proj")].scaling
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        random_adapter(cfg, "x", np.int64(0), ("q_proj",))
