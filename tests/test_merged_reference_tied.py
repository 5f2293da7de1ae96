"""The dense merged-weights oracle (runtime_helpers.merged_model) with tied embeddings: an
adapter on lm_head alone must leave the embedding lookup unchanged (PEFT wraps the Linear;
the tied tensor is the base), as the runtime serves it. Before the fix the lm_head delta was
added into the shared tensor, so the reference also changed every token's embedding."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_runtime, merged_model, reference_logits

from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import LlamaConfig


@pytest.mark.parametrize("targets", [["lm_head"], ["lm_head", "embed_tokens"],
                                     ["embed_tokens", "lm_head", "o_proj"]])
def test_merged_model_tied_lm_head_adapter(targets):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    runner = make_runtime(cfg, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                          max_rank=4, targets=tuple(targets))
    served_emb = runner.model.model.embed_tokens
    served_emb = getattr(served_emb, "base", served_emb)  # the wrapper's base nn.Embedding
    emb = served_emb.weight.detach().clone()
    ad = random_adapter(cfg, "a", 4, targets, seed=1, b_std=0.3)
    runner.lora.load_adapter("a", ad)
    ref_model = merged_model(runner.model, ad)
    if "embed_tokens" not in targets:
        assert torch.equal(ref_model.model.embed_tokens.weight, emb)
    assert torch.equal(served_emb.weight, emb)  # the served model's base is untouched too
    tokens = [3, 17, 42]
    req = Request(tokens, "a", 1)
    got = runner.forward_eager(build_extend([req], runner.kv, "cpu"))[0]
    release([req], runner.kv)
    want = reference_logits(ref_model, tokens, torch.float32, "cpu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
