"""A mixed batch (several adapters, different ranks, requests without adapter) gives, per
request, the logits of a dense model merged with that request's adapter, in prefill and in
decode, on both backends."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, ON_GPU
from runtime_helpers import ALL_TARGETS, make_runtime, merged_model, reference_logits

from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny

CFG = tiny()
TIED = dataclasses.replace(CFG, tie_word_embeddings=True)


def _adapters():
    a = random_adapter(CFG, "a", 4, alpha=8, seed=1, b_std=0.3)
    b = random_adapter(CFG, "b", 8, ("q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"),
                       use_rslora=True, alpha=4, seed=2, b_std=0.3)
    c = random_adapter(CFG, "c", 2, ("gate_proj", "up_proj", "o_proj", "k_proj"), seed=3,
                       b_std=0.5)
    return {x.name: x for x in (a, b, c)}


DTYPES = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])


def _close(got, ref, dtype, what):
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=what)
    else:  # bf16: merged weights and the LoRA path round differently; compare as vectors
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 3e-2, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend, config", [("torch", CFG), ("triton", CFG), ("torch", TIED)],
                         ids=["torch", "triton", "torch-tied-embeddings"])
def test_mixed_batch_matches_merged_dense_models(backend, config, dtype):
    runner = make_runtime(config, dtype=dtype, device=DEVICE, backend=backend, slots=3, max_rank=8,
                          targets=ALL_TARGETS)
    adapters = _adapters()
    for name, ad in adapters.items():
        runner.lora.load_adapter(name, ad)
    g = torch.Generator().manual_seed(0)
    names = ["a", None, "b", "a", "c", None]
    reqs = [Request(torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist(), name, 2)
            for n, name in zip([5, 3, 7, 1, 4, 2], names, strict=True)]
    merged = {n: merged_model(runner.model, adapters.get(n)) for n in set(names)}

    prefill = runner.forward_eager(build_extend(reqs, runner.kv, DEVICE))
    for r, row in zip(reqs, prefill, strict=True):
        r.output.append(int(row.argmax()))
    decode = runner.forward_eager(build_decode(reqs, runner.kv, DEVICE))
    release(reqs, runner.kv)

    lora_seen = 0.0
    for i, r in enumerate(reqs):
        base = reference_logits(merged[None], r.prompt, dtype, DEVICE)
        ref_p = reference_logits(merged[r.adapter], r.prompt, dtype, DEVICE)
        ref_d = reference_logits(merged[r.adapter], r.tokens, dtype, DEVICE)
        _close(prefill[i], ref_p, dtype, f"prefill {i}")
        _close(decode[i], ref_d, dtype, f"decode {i}")
        lora_seen = max(lora_seen, ((ref_p - base).norm() / base.norm()).item())
    assert lora_seen > 0.2, "the adapters must change the logits, or this test proves nothing"
