"""The LoRA backend: owns the per-batch state and the graph hooks.

Contract (README, "Contracts"):
1. ``batch_info is None`` means no batch is prepared. ``prepare`` sets it for one forward;
   ``reset_batch_state`` clears it *and every per-batch state derived from it*.
2. Layers gate on ``batch_info is not None``; ``run_*`` refuses to run without it.
4. Under graphs, ``batch_info`` points at static buffers that ``prepare_for_replay`` refreshes
   in place; unused rows and blocks are neutral (the rank-0 slot, empty blocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kernels import LoRAWeights, SegmentLayout, StaticSegmentLayout
from lora_runtime.lora.batch_info import LOGITS_BLOCK_M, LoRABatchInfo, LoRABatchPlan


class RowSet(enum.Enum):
    TOKENS = "tokens"
    LOGITS = "logits"


@dataclass
class LoRAGraphBuffers:
    """Static LoRA metadata of one graph runner: every graph it captures reads these."""

    tokens: StaticSegmentLayout
    logits: StaticSegmentLayout


class LoRABackend:
    name = "base"

    def __init__(self, num_slots: int, device) -> None:
        self.num_slots = num_slots
        self.neutral_slot = num_slots
        self.device = torch.device(device)
        self.batch_info: LoRABatchInfo | None = None
        self.logits_info: SegmentLayout | None = None  # derived per batch: the lm_head pass

    # -- batch-state contract -------------------------------------------------------------
    def prepare(self, plan: LoRABatchPlan) -> None:
        """Eager forward: exact-size metadata, one host-to-device copy per layout."""
        self._set(LoRABatchInfo.from_plan(plan, self.device),
                  SegmentLayout.from_plan(plan.logits_rows, self.device))

    def _set(self, info: LoRABatchInfo, logits: SegmentLayout) -> None:
        self.reset_batch_state()
        self.batch_info = info
        self.logits_info = logits

    def reset_batch_state(self) -> None:
        """Clears the batch and everything derived from it (subclasses extend this)."""
        self.batch_info = None
        self.logits_info = None

    # -- called by LoRA layers ------------------------------------------------------------
    def run_linear(self, x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights,
                   rows: RowSet = RowSet.TOKENS) -> None:
        """``y += LoRA(x)`` in place for the rows of the prepared batch."""
        layout = self._layout(rows, "run_linear")
        self.expand(self.shrink(x, weights, layout), weights, y, layout)

    def run_embedding(self, token_ids: torch.Tensor, y: torch.Tensor,
                      weights: LoRAWeights) -> None:
        layout = self._layout(RowSet.TOKENS, "run_embedding")
        self.expand(self.embedding_shrink(token_ids, weights, layout), weights, y, layout)

    def _layout(self, rows: RowSet, what: str) -> SegmentLayout:
        if self.batch_info is None:
            raise RuntimeError(
                f"{self.name} backend {what}: no LoRA batch is prepared (batch_info is None). "
                "Call LoRAManager.prepare_lora_batch(forward_batch) before the forward; layers "
                "must gate on lora_active, which is False while batch_info is None"
            )
        if rows is RowSet.TOKENS:
            return self.batch_info.rows
        if self.logits_info is None:
            raise RuntimeError(f"{self.name} backend {what}: the batch has no lm_head pass")
        return self.logits_info

    # -- kernels (subclasses) ---------------------------------------------------------------
    def shrink(self, x, weights, layout) -> torch.Tensor:
        raise NotImplementedError

    def expand(self, a, weights, y, layout) -> None:
        raise NotImplementedError

    def embedding_shrink(self, token_ids, weights, layout) -> torch.Tensor:
        raise NotImplementedError

    # -- graph hooks ------------------------------------------------------------------------
    def init_capture_buffers(self, max_rows: int, max_requests: int,
                             block_m: int) -> LoRAGraphBuffers:
        """Static metadata for a graph runner (allocated once; the runner owns it)."""
        slots = self.num_slots + 1
        return LoRAGraphBuffers(
            StaticSegmentLayout(max_rows, slots, block_m, self.neutral_slot, self.device),
            StaticSegmentLayout(max_requests, slots, LOGITS_BLOCK_M, self.neutral_slot,
                                self.device),
        )

    def prepare_for_capture(self, buffers: LoRAGraphBuffers, rows: int, requests: int) -> None:
        """Points ``batch_info`` at the static buffers, neutral, for a capture of this size."""
        self.prepare_for_replay(buffers, None, rows, requests)

    def prepare_for_replay(self, buffers: LoRAGraphBuffers, plan: LoRABatchPlan | None,
                           rows: int, requests: int) -> None:
        """Refreshes the static buffers in place (None: an idle batch, all neutral)."""
        buffers.tokens.write(None if plan is None else plan.rows, rows)
        buffers.logits.write(None if plan is None else plan.logits_rows, requests)
        self._set(LoRABatchInfo(buffers.tokens.view(rows)), buffers.logits.view(requests))
