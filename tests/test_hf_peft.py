"""External check: a tiny random Llama built with transformers (no download) and adapters
attached with peft, saved in their formats and loaded here, give the same logits per request
and the same greedy generations as transformers + peft."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_runtime.engine.engine import Engine  # noqa: E402
from lora_runtime.engine.kv_cache import KVCache  # noqa: E402
from lora_runtime.engine.model_runner import ModelRunner  # noqa: E402
from lora_runtime.engine.requests import Request, build_extend, release  # noqa: E402
from lora_runtime.lora.lora_config import LoRAConfig  # noqa: E402
from lora_runtime.lora.manager import LoRAManager  # noqa: E402
from lora_runtime.model.checkpoint import load_hf_llama  # noqa: E402

ADAPTERS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=4, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]),
    "patterns": dict(r=4, lora_alpha=16, target_modules="all-linear",
                     rank_pattern={"q_proj": 2, "down_proj": 6},
                     alpha_pattern={"up_proj": 3}),
    "embed_head": dict(r=2, lora_alpha=2, target_modules=["embed_tokens", "lm_head", "o_proj"]),
}


def _hf_config(tied: bool, llama3_rope: bool):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
              attn_implementation="eager")
    if llama3_rope:
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return transformers.LlamaConfig(**kw)


@pytest.fixture(scope="module", params=[(False, False), (True, True)],
                ids=["untied", "tied+llama3"])
def saved(request, tmp_path_factory):
    tied, llama3 = request.param
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_hf_config(tied, llama3)).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    models = {}
    for name, kw in ADAPTERS.items():
        if tied and "lm_head" in kw["target_modules"]:
            continue
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw)).eval()
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_B" in pname or "lora_embedding_B" in pname:
                    p.normal_(0, 0.3)
        pm.save_pretrained(root / name)
        models[name] = pm
    return root, base, models


def _runtime(root, names):
    model = load_hf_llama(root / "base", torch.float32, DEVICE)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "embed_tokens", "lm_head")
    lora = LoRAManager(model, LoRAConfig(4, 8, targets, "triton"))
    for n in names:
        lora.load_adapter(n, root / n)
    return ModelRunner(model, KVCache(model.config, 256, torch.float32, DEVICE), lora)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 9, (n,), generator=g)]


def test_logits_match_transformers_and_peft_per_request(saved):
    root, base, models = saved
    runner = _runtime(root, list(models))
    names = [*models, None, *models]
    prompts = _prompts(len(names))
    reqs = [Request(p, n, 1) for p, n in zip(prompts, names, strict=True)]
    ours = runner.forward_eager(build_extend(reqs, runner.kv, DEVICE)).cpu()
    release(reqs, runner.kv)
    for i, (p, n) in enumerate(zip(prompts, names, strict=True)):
        ref_model = base if n is None else models[n]
        with torch.no_grad():
            ref = ref_model(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-4, msg=f"request {i} ({n})")


def test_greedy_generations_agree(saved):
    root, base, models = saved
    runner = _runtime(root, list(models))
    names = [None, *models]
    prompts = _prompts(len(names), seed=1)
    ours = Engine(runner).generate(prompts, names, max_new_tokens=6)
    for p, n, got in zip(prompts, names, ours, strict=True):
        ref_model = base if n is None else models[n]
        with torch.no_grad():
            out = ref_model.generate(
                input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert got == out[0, len(p):].tolist(), f"adapter {n}"
