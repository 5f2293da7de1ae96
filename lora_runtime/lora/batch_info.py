"""``LoRABatchInfo``: what LoRA layers read for one forward, and its host-side plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import SegmentLayout, SegmentPlan

DECODE_BLOCK_M = 16  # decode blocks hold few rows: small blocks, more programs
EXTEND_BLOCK_M = 64  # prefill blocks reuse each weight tile across more rows
LOGITS_BLOCK_M = 16


@dataclass(frozen=True)
class LoRABatchPlan:
    """Host-side plan: built from the batch's adapters before anything touches the device."""

    rows: SegmentPlan
    """Token rows (embedding and every linear layer)."""
    logits_rows: SegmentPlan
    """Rows that reach lm_head: one per request (the last token in prefill)."""
    gathered: SegmentPlan | None = None
    """Data-parallel attention: the MLP's rows, gathered from every rank (None: the MLP runs
    on ``rows``)."""

    @property
    def has_local_adapters(self) -> bool:
        return bool(self.rows.blocks) or bool(self.logits_rows.blocks)

    @property
    def has_adapters(self) -> bool:
        return self.has_local_adapters or bool(self.gathered and self.gathered.blocks)


@dataclass
class LoRABatchInfo:
    """Device-side metadata of the token rows of one forward. Layers must not run LoRA
    without it. (The lm_head pass over logits rows is derived state the backend keeps beside
    it, cleared with it.)"""

    rows: SegmentLayout

    @staticmethod
    def from_plan(plan: LoRABatchPlan, device: torch.device) -> LoRABatchInfo:
        return LoRABatchInfo(SegmentLayout.from_plan(plan.rows, device))
