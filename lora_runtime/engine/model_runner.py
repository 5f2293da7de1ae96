"""``ModelRunner``: one eager forward of a batch (LoRA prepared first), and greedy generation
that replays captured graphs where a graph runner can take the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.llama import LlamaForCausalLM


class GraphReplayer(Protocol):
    def can_run(self, batch: ForwardBatch) -> bool: ...
    def replay(self, batch: ForwardBatch) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, lora: LoRAManager | None) -> None:
        self.model, self.kv, self.lora = model, kv, lora
        self.device = next(model.parameters()).device
        self.graphs: list[GraphReplayer] = []

    @torch.no_grad()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        if self.lora is not None and batch.mode is not ForwardMode.IDLE:
            self.lora.prepare_lora_batch(batch)
        return self.model(batch, self.kv)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of ``batch.logits_rows``: a graph replay when one fits, else eager."""
        for g in self.graphs:
            if g.can_run(batch):
                return g.replay(batch)
        return self.forward_eager(batch)

    def idle_batch(self) -> ForwardBatch:
        return ForwardBatch.idle(self.lora, self.device)

    def generate(self, requests: Sequence[Request]) -> list[list[int]]:
        """Greedy decoding: one prefill of all requests, then decode steps until each is done.
        Returns each request's new tokens."""
        active = list(requests)
        try:
            logits = self.forward(build_extend(active, self.kv, self.device))
            self._append(active, logits)
            while active := [r for r in active if not r.done]:
                logits = self.forward(build_decode(active, self.kv, self.device))
                self._append(active, logits)
        finally:
            release(requests, self.kv)
        return [list(r.output) for r in requests]

    @staticmethod
    def _append(reqs: Sequence[Request], logits: torch.Tensor) -> None:
        for r, tok in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            r.output.append(tok)
