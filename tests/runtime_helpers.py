"""Building tiny runtimes and the dense merged-weights reference for tests."""

from __future__ import annotations

import copy

import torch

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import LoRAAdapter, random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.llama import LlamaForCausalLM
from lora_runtime.model.modules import BY_NAME, TARGETS

ALL_TARGETS = tuple(t.name for t in TARGETS)


def drawn_adapter(config: LlamaConfig, name: str, seed: int, max_rank: int) -> LoRAAdapter:
    """A random adapter whose rank, targets, alpha and rsLoRA flag are drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    rank = int(torch.randint(1, max_rank + 1, (1,), generator=g))
    pick = torch.rand(len(ALL_TARGETS), generator=g) < 0.6
    targets = [t for t, p in zip(ALL_TARGETS, pick, strict=True) if p] or ["o_proj"]
    return random_adapter(config, name, rank, targets, seed=seed, b_std=0.3,
                          use_rslora=bool(seed % 2), alpha=float(rank + seed % 3))


def make_runtime(config: LlamaConfig, *, dtype, device, backend="torch", slots=4, max_rank=16,
                 targets=ALL_TARGETS, kv_tokens=512, seed=0, model=None):
    model = model or LlamaForCausalLM.random(config, dtype, device, seed=seed)
    lora = LoRAManager(model, LoRAConfig(slots, max_rank, tuple(targets), backend))
    return ModelRunner(model, KVCache(config, kv_tokens, dtype, device), lora)


@torch.no_grad()
def merged_model(base: LlamaForCausalLM, adapter: LoRAAdapter | None) -> LlamaForCausalLM:
    """A plain model whose weights are ``W + s * B @ A`` of ``adapter`` (unwrapped copy)."""
    model = copy.deepcopy(_unwrapped(base))
    if adapter is None:
        return model
    cfg = model.config
    if model.lm_head.weight is model.model.embed_tokens.weight:
        # Tied: an embed_tokens adapter changes the lookup only, an lm_head one the head only
        # (PEFT wraps each module over the shared base tensor).
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for (layer, target), m in adapter.modules.items():
        delta = m.scaling * (m.b.double() @ m.a.double())
        if target == "embed_tokens":
            w = model.model.embed_tokens.weight
            w += delta.t().to(w.dtype).to(w.device)
            continue
        if target == "lm_head":
            model.lm_head.weight += delta.to(model.lm_head.weight.dtype).to(
                model.lm_head.weight.device)
            continue
        blk = model.model.layers[layer]
        t = BY_NAME[target]
        mod = getattr(getattr(blk, t.block), t.module)
        widths = cfg.module_shape(t.module).slice_widths
        lo = sum(widths[: t.slice])
        rows = mod.weight[lo : lo + widths[t.slice]]
        rows += delta.to(rows.dtype).to(rows.device)
    return model


def _unwrapped(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A deep copy with every LoRA wrapper replaced by its base layer."""
    clone = copy.deepcopy(model)
    for parent in [clone.model, clone] + [m for layer in clone.model.layers
                                           for m in (layer.self_attn, layer.mlp)]:
        for name, child in list(parent.named_children()):
            if hasattr(child, "base") and hasattr(child, "lora"):
                setattr(parent, name, child.base)
    if clone.config.tie_word_embeddings:
        clone.lm_head.weight = clone.model.embed_tokens.weight
    return clone


def reference_logits(model: LlamaForCausalLM, tokens: list[int], dtype, device) -> torch.Tensor:
    """Last-position logits of ``tokens`` run from scratch through a plain model."""
    kv = KVCache(model.config, len(tokens) + 1, dtype, device)
    runner = ModelRunner(model, kv, None)
    req = Request(list(tokens), None, 1)
    logits = runner.forward_eager(build_extend([req], kv, device))
    release([req], kv)
    return logits[0]
