"""``LoRABatchInfo``: what LoRA layers read for one forward, and its host-side plan."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kernels import SegmentLayout, SegmentPlan, SegmentSpec

DECODE_BLOCK_M = 16  # decode blocks hold few rows: small blocks, more programs
EXTEND_BLOCK_M = 64  # prefill blocks reuse each weight tile across more rows
LOGITS_BLOCK_M = 16


@dataclass(frozen=True)
class LoRABatchPlan:
    """Host-side plan: built from the batch's adapters before anything touches the device.
    It holds what each layout is planned from (``SegmentSpec``); the layouts themselves are
    planned on first use, so a graph replay whose static buffers already hold them plans
    nothing."""

    rows_spec: SegmentSpec
    """Token rows (embedding and every linear layer)."""
    logits_spec: SegmentSpec
    """Rows that reach lm_head: one per request (the last token in prefill)."""
    gathered_spec: SegmentSpec | None = None
    """Data-parallel attention: the MLP's rows, gathered from every rank (None: the MLP runs
    on ``rows``)."""

    @functools.cached_property
    def rows(self) -> SegmentPlan:
        return self.rows_spec.plan()

    @functools.cached_property
    def logits_rows(self) -> SegmentPlan:
        # Decode: one row per request, so the lm_head pass often has the rows' very layout.
        return self.rows if self.logits_spec == self.rows_spec else self.logits_spec.plan()

    @functools.cached_property
    def gathered(self) -> SegmentPlan | None:
        return None if self.gathered_spec is None else self.gathered_spec.plan()

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
