"""``ModelRunner``: one eager forward of a batch, LoRA prepared (or reset) first. Graph
replays and the serving loop sit above it (``graphs.GraphRunner``, ``Engine``)."""

from __future__ import annotations

import torch

from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, lora: LoRAManager | None) -> None:
        self.model, self.kv, self.lora = model, kv, lora
        self.device = next(model.parameters()).device
        self.dp = model.dp
        """The data-parallel group when the model's MLP is sharded for DP attention."""

    @torch.no_grad()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (the model's dtype) of ``batch.logits_rows``."""
        if self.lora is not None and (batch.mode is not ForwardMode.IDLE
                                      or batch.gathered is not None):
            self.lora.prepare_lora_batch(batch)
        return self.model(batch, self.kv)

    def idle_batch(self) -> ForwardBatch:
        return ForwardBatch.idle(self.lora, self.device)
