"""``ModelRunner``: one eager forward of a batch, LoRA prepared (or reset) first. Graph
replays and the serving loop sit above it (``graphs.GraphRunner``, ``Engine``)."""

from __future__ import annotations

import torch

from lora_runtime.engine.forward_batch import ForwardBatch, check_gathered
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, lora: LoRAManager | None) -> None:
        self.model, self.kv, self.lora = model, kv, lora
        param = next(model.parameters())
        self.device = param.device
        _check_cache(kv, model, param)

    @property
    def dp(self):
        """The data-parallel group when the model's MLP is sharded for DP attention (read from
        the model: a runner built before ``shard_mlp`` took the model as unsharded)."""
        return self.model.dp

    @torch.no_grad()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (the model's dtype) of ``batch.logits_rows``."""
        check_gathered(batch, self.dp)  # before any LoRA state or collective
        if self.lora is not None:
            # An idle batch resets the LoRA state here too: one built before a LoRA step and
            # forwarded after it found that step's metadata (contract 3).
            self.lora.prepare_lora_batch(batch)
        return self.model(batch, self.kv)

    def idle_batch(self) -> ForwardBatch:
        return ForwardBatch.idle(self.lora, self.device)


def _check_cache(kv: KVCache, model: LlamaForCausalLM, param: torch.Tensor) -> None:
    """The cache must be built for this model: its layers, KV heads, head size, dtype and
    device (a mismatch would fail deep inside the first forward, naming neither)."""
    c = model.config
    k = kv.k[0]
    got = (len(kv.k), tuple(k.shape[1:]), k.dtype, k.device)
    want = (c.num_layers, (c.num_kv_heads, c.head_dim), param.dtype, param.device)
    if got != want:
        raise ValueError(f"the KV cache holds (layers, (kv heads, head_dim), dtype, device) "
                         f"{got}, the model needs {want}: build it as KVCache(model.config, "
                         "max_tokens, <the model's dtype>, <the model's device>)")
