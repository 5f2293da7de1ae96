"""The model and its loading, ninth hunt. An incomplete checkpoint names the field that would
fix it (a config of more layers than the checkpoint holds, an untied config of a checkpoint
without lm_head), a tied lm_head of another shape is refused for its shape, a model built
in a dtype it cannot compute in is refused where it is built, and the float64 reference
refuses a probe with no token instead of giving it another probe's row."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_errors import _tensors, _write

from bench.float64_model import Probe, last_logits_f64
from lora_runtime.model.checkpoint import CheckpointError, load_hf_llama
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM


def test_a_config_of_more_layers_than_the_checkpoint_names_num_hidden_layers(tmp_path):
    """It said only 'checkpoint lacks 9 tensors, e.g. [model.layers.1...]'."""
    _write(tmp_path / "ck", [_tensors(tied=False)], num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"lacks 18 tensors.*holds layers 0\.\.0; "
                                              r"config\.json's num_hidden_layers is 3: set it "
                                              r"to 1"):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


def test_an_untied_config_of_a_checkpoint_without_lm_head_names_tie_word_embeddings(tmp_path):
    _write(tmp_path / "ck", [_tensors(tied=True)])
    with pytest.raises(CheckpointError, match=r"\['lm_head\.weight'\].*tie_word_embeddings "
                                              r"is false"):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


def test_a_checkpoint_missing_other_tensors_says_it_is_incomplete(tmp_path):
    t = _tensors(tied=False)
    del t["model.norm.weight"], t["model.layers.0.mlp.up_proj.weight"]
    _write(tmp_path / "ck", [t])
    with pytest.raises(CheckpointError, match=r"lacks 2 tensors.*incomplete"):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


@pytest.mark.parametrize("head, says", [
    # It said the head 'differs from its embed_tokens.weight: set tie_word_embeddings to
    # false', a fix that then failed on the shape.
    (torch.ones(31, 16), r"lm_head\.weight has shape \(31, 16\), expected \(32, 16\)"),
    (torch.ones(32, 16, dtype=torch.int8), r"lm_head\.weight has dtype torch\.int8"),
])
def test_a_tied_lm_head_the_model_cannot_hold_is_refused_for_what_it_is(tmp_path, head, says):
    t = _tensors(tied=True) | {"lm_head.weight": head}
    _write(tmp_path / "ck", [t], tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=says):
        load_hf_llama(tmp_path / "ck", torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, "bfloat16", torch.int8])
def test_a_model_built_in_a_dtype_it_cannot_compute_in_is_refused(dtype):
    """float8 was built and failed at its first forward ('"neg_cpu" not implemented');
    "bfloat16" raised 'Invalid device string'."""
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype the model "
                                        r"computes in \(.*torch.bfloat16.*\)"):
        LlamaForCausalLM.random(tiny(1), dtype, "cpu")
    assert LlamaForCausalLM.random(tiny(1), torch.float64, "cpu") is not None


@pytest.mark.parametrize("empty_first", [True, False])
def test_the_float64_reference_refuses_a_probe_with_no_token(empty_first):
    """A probe of no tokens was given the row of the probe before it (the first one, the
    batch's last row): a duplicate row, silently."""
    model = LlamaForCausalLM.random(tiny(1), torch.float32, "cpu")
    with pytest.raises(ValueError, match="Probe needs at least one token"):
        probes = [Probe(()), Probe((1, 2, 3))] if empty_first else [Probe((1, 2, 3)), Probe(())]
        last_logits_f64(model, probes)
