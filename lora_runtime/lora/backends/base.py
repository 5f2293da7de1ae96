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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import LoRAWeights, SegmentLayout, StaticSegmentLayout
from kernels.row_lora import UnshrunkLoRA
from lora_runtime.lora.batch_info import LOGITS_BLOCK_M, LoRABatchInfo, LoRABatchPlan
from lora_runtime.lora.linear_schedule import lora_linear
from lora_runtime.lora.side_stream import run_beside
from lora_runtime.model.gemm_library import sms_left_free

EAGER_LAYOUTS_KEPT = 8
"""Eager layouts kept for reuse, most recent last (``LoRABackend.prepare``)."""


class RowSet(enum.Enum):
    TOKENS = "tokens"
    LOGITS = "logits"
    GATHERED = "gathered"
    """The MLP's rows: this rank's tokens, or under DP attention every rank's, gathered."""


@dataclass
class LoRAGraphBuffers:
    """Static LoRA metadata of one graph runner: every graph it captures reads these."""

    tokens: StaticSegmentLayout
    logits: StaticSegmentLayout
    gathered: StaticSegmentLayout | None = None
    """Under DP attention: ``dp_size`` times the token rows."""


class LoRABackend:
    name = "base"

    def __init__(self, num_slots: int, device) -> None:
        self.num_slots = num_slots
        self.neutral_slot = num_slots
        self.device = torch.device(device)
        self.batch_info: LoRABatchInfo | None = None
        self.logits_info: SegmentLayout | None = None  # derived per batch: the lm_head pass
        # The MLP's layout: batch_info's rows, or under DP the gathered rows (then it may be
        # set while batch_info is None: an idle rank's MLP serves the other ranks' tokens).
        self.gathered_info: SegmentLayout | None = None
        self.routes: dict | None = None
        """Route decisions memoised for the forward of an eager ``prepare`` (None otherwise:
        a capture's warm-up call runs eagerly under the same graph hooks, so there each call
        decides for itself)."""
        # Invariant: an eager layout is a pure function of its specs and never written after
        # its copy, so reusing it for an equal batch cannot read a previous batch's rows.
        self._eager_layouts: dict[tuple, tuple] = {}

    # -- batch-state contract -------------------------------------------------------------
    def prepare(self, plan: LoRABatchPlan) -> None:
        """Eager forward: exact-size metadata, one host-to-device copy for all its layouts.
        Under DP, a rank whose own rows have no adapter keeps ``batch_info`` None. A batch
        planned like one of the last ``EAGER_LAYOUTS_KEPT`` (equal specs: consecutive decode
        steps of an unchanged batch) reuses its layouts: no planning, no copy."""
        key = (plan.rows_spec, plan.logits_spec, plan.gathered_spec)
        layouts = self._eager_layouts.pop(key, None)
        if layouts is None:
            layouts = self._eager_layouts_of(plan)
            if len(self._eager_layouts) >= EAGER_LAYOUTS_KEPT:
                del self._eager_layouts[next(iter(self._eager_layouts))]  # least recent
        self._eager_layouts[key] = layouts
        rows, logits, gathered = layouts
        self._set(None if rows is None else LoRABatchInfo(rows), logits, gathered)
        self.routes = {}

    def _eager_layouts_of(self, plan: LoRABatchPlan) -> tuple:
        """``(rows, logits, gathered)`` layouts of ``plan`` on the device, built by one copy
        (rows and logits None on a DP rank without local adapters). A plan that serves two
        of them (decode: the logits rows are the token rows) is packed once."""
        local = plan.gathered is None or plan.has_local_adapters
        wanted = [plan.rows if local else None, plan.logits_rows if local else None,
                  plan.gathered]
        unique = list({id(p): p for p in wanted if p is not None}.values())
        built = dict(zip(map(id, unique), SegmentLayout.from_plans(unique, self.device),
                         strict=True))  # one copy for all
        return tuple(None if p is None else built[id(p)] for p in wanted)

    def _set(self, info: LoRABatchInfo | None, logits: SegmentLayout | None,
             gathered: SegmentLayout | None = None) -> None:
        self.reset_batch_state()
        self.batch_info = info
        self.logits_info = logits
        self.gathered_info = gathered if gathered is not None else (
            None if info is None else info.rows)

    def reset_batch_state(self) -> None:
        """Clears the batch and everything derived from it (subclasses extend this)."""
        self.batch_info = None
        self.logits_info = None
        self.gathered_info = None
        self.routes = None

    def layout_ready(self, rows: RowSet) -> bool:
        """Whether layers reading ``rows`` have prepared metadata (their ``lora_active``)."""
        if rows is RowSet.GATHERED:
            return self.gathered_info is not None
        return self.batch_info is not None

    # -- called by LoRA layers ------------------------------------------------------------
    def linear(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               weights: LoRAWeights, rows: RowSet = RowSet.TOKENS) -> torch.Tensor:
        """``base(x) + LoRA(x)`` for the rows of the prepared batch; inside a graph capture
        the LoRA kernels run beside the base GEMM (``linear_schedule``)."""
        if self.one_launch(x, weights, rows):
            return self.linear_one_launch(base, x, weights, rows)
        return self.linear_split(base, x, weights, rows)

    def linear_split(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     weights: LoRAWeights, rows: RowSet = RowSet.TOKENS) -> torch.Tensor:
        """``linear`` as shrink and expand around the base GEMM (the caller ruled out the
        one-launch route)."""
        layout = self._layout(rows, "linear")
        return lora_linear(base, x, lambda v: self.shrink(v, weights, layout),
                           lambda a, y: self.expand(a, weights, y, layout))

    def one_launch(self, x: torch.Tensor, weights: LoRAWeights, rows: RowSet) -> bool:
        """Whether ``linear`` adds the LoRA term in one kernel (``shrink_expand``) after the
        base GEMM instead of shrink and expand around it."""
        return False

    def linear_one_launch(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                          weights: LoRAWeights, rows: RowSet = RowSet.TOKENS) -> torch.Tensor:
        """``linear`` where ``one_launch`` holds (the caller checked it)."""
        layout = self._layout(rows, "linear")
        y = base(x)
        self.shrink_expand(x, weights, y, layout)
        return y

    def fuses_expand(self, x: torch.Tensor, weights: LoRAWeights, consumer: str) -> bool:
        """Whether a projection of ``x``'s rows may leave its expand to ``consumer``
        (``linear_deferred``; "rope" for qkv, "silu_mul" for gate_up): only backends whose
        consumer kernels read its layout."""
        return False

    def linear_deferred(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                        weights: LoRAWeights, rows: RowSet = RowSet.TOKENS):
        """``(base(x), PendingLoRA)``: the shrink runs (beside the GEMM under a capture), the
        expand is left to the consumer of the output (``kernels.lora_epilogue``)."""
        from kernels.lora_epilogue import PendingLoRA

        layout = self._layout(rows, "linear")
        a, y = run_beside(lambda: self.shrink(x, weights, layout), lambda: base(x), x)
        return y, PendingLoRA(a, weights, layout)

    def shrinks_in_consumer(self, x: torch.Tensor, weights: LoRAWeights, consumer: str,
                            rows: RowSet = RowSet.TOKENS) -> bool:
        """Whether a projection of ``x``'s rows (those of ``rows``' layout) leaves its whole
        LoRA term, shrink included, to ``consumer`` ("rope", "silu_mul", "norm";
        ``linear_unshrunk``): only backends whose consumer kernels compute it (eager forwards
        of few rows)."""
        return False

    def linear_unshrunk(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                        weights: LoRAWeights, rows: RowSet = RowSet.TOKENS):
        """``(base(x), UnshrunkLoRA)``: no LoRA kernel here; the consumer of the output
        computes each row's term from ``x`` (``kernels.row_lora``)."""
        return base(x), UnshrunkLoRA(x, weights, self._layout(rows, "linear"))

    def expand_beside(self, x: torch.Tensor, consumer: str) -> bool:
        """Whether a projection of ``x``'s rows computes its LoRA term beside the base GEMM
        into a float32 delta that ``consumer`` adds (``linear_delta``; "norm" for o_proj and
        down, "rope" for qkv, "silu_mul" for gate_up): only backends whose expand writes a
        float32 delta."""
        return False

    def linear_delta(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     weights: LoRAWeights, rows: RowSet = RowSet.TOKENS):
        """``(base(x), LoRADelta)``: shrink and expand run on the side branch into a zeroed
        float32 delta (beside the GEMM under a capture), for the next norm or consumer kernel
        to add (``kernels.lora_epilogue.LoRADelta``). The term leaves the GEMM's critical
        path; rows without an adapter keep a zero delta."""
        from kernels.lora_epilogue import LoRADelta

        layout = self._layout(rows, "linear")

        def side() -> torch.Tensor:
            a, delta = self.shrink_with_delta(x, weights, layout)
            self.expand(a, weights, delta, layout)
            return delta

        def main() -> torch.Tensor:
            with sms_left_free(x):
                return base(x)

        delta, y = run_beside(side, main, x)
        return y, LoRADelta(delta)

    def run_embedding(self, token_ids: torch.Tensor, y: torch.Tensor,
                      weights: LoRAWeights) -> None:
        layout = self._layout(RowSet.TOKENS, "run_embedding")
        self.expand(self.embedding_shrink(token_ids, weights, layout), weights, y, layout)

    def ready_layout(self, rows: RowSet) -> SegmentLayout | None:
        """The prepared layout of ``rows``, or None where there is none."""
        if rows is RowSet.TOKENS:
            return None if self.batch_info is None else self.batch_info.rows
        return self.gathered_info if rows is RowSet.GATHERED else self.logits_info

    def _layout(self, rows: RowSet, what: str) -> SegmentLayout:
        if not self.layout_ready(rows):
            state = "gathered_info" if rows is RowSet.GATHERED else "batch_info"
            raise RuntimeError(
                f"{self.name} backend {what}: no LoRA batch is prepared ({state} is None). "
                "Call LoRAManager.prepare_lora_batch(forward_batch) before the forward; layers "
                f"must gate on lora_active, which is False while {state} is None"
            )
        layout = self.ready_layout(rows)
        if layout is None:  # logits rows of a batch whose lm_head pass was not planned
            raise RuntimeError(f"{self.name} backend {what}: the batch has no lm_head pass")
        return layout

    # -- kernels (subclasses) ---------------------------------------------------------------
    def shrink(self, x, weights, layout) -> torch.Tensor:
        raise NotImplementedError

    def expand(self, a, weights, y, layout) -> None:
        raise NotImplementedError

    def shrink_with_delta(self, x, weights, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shrink(x), zeroed float32 [rows, out])``: backends whose ``expand_beside`` can
        be true (one memset for both: every node on the side branch delays the join)."""
        raise NotImplementedError

    def embedding_shrink(self, token_ids, weights, layout) -> torch.Tensor:
        raise NotImplementedError

    def shrink_expand(self, x, weights, y, layout) -> None:
        raise NotImplementedError

    # -- graph hooks ------------------------------------------------------------------------
    def init_capture_buffers(self, max_rows: int, max_requests: int,
                             block_m: int, dp_size: int = 1) -> LoRAGraphBuffers:
        """Static metadata for a graph runner (allocated once; the runner owns it)."""
        slots = self.num_slots + 1
        layout = lambda rows, bm: StaticSegmentLayout(  # noqa: E731
            rows, slots, bm, self.neutral_slot, self.device)
        return LoRAGraphBuffers(
            layout(max_rows, block_m),
            layout(max_requests, LOGITS_BLOCK_M),
            layout(dp_size * max_rows, block_m) if dp_size > 1 else None,
        )

    def prepare_for_capture(self, buffers: LoRAGraphBuffers, rows: int, requests: int,
                            local: bool = True) -> None:
        """Points ``batch_info`` at the static buffers, neutral, for a capture of this size."""
        self.prepare_for_replay(buffers, None, rows, requests, local)

    def prepare_for_replay(self, buffers: LoRAGraphBuffers, plan: LoRABatchPlan | None,
                           rows: int, requests: int, local: bool = True) -> None:
        """Refreshes the static buffers in place (None: an idle batch, all neutral). A layout
        the buffers already hold (same ``SegmentSpec``) is neither planned nor copied again;
        every other one is planned, and checked against its view, before any buffer is
        written. ``local=False`` (under DP,
        a rank whose own rows have no adapter): only the MLP's gathered layout is refreshed
        and set; ``batch_info`` stays None, so the rank's own layers run no LoRA."""
        if not local and buffers.gathered is None:
            raise ValueError("local=False needs the gathered layout of DP attention")
        gathered_rows = 0
        # (layout, its spec, its view's rows, the plan's field holding its planned layout)
        todo = [] if not local else [
            (buffers.tokens, None if plan is None else plan.rows_spec, rows, "rows"),
            (buffers.logits, None if plan is None else plan.logits_spec, requests,
             "logits_rows")]
        if buffers.gathered is not None:
            gathered_rows = rows * (buffers.gathered.max_rows // buffers.tokens.max_rows)
            todo.append((buffers.gathered, None if plan is None else plan.gathered_spec,
                         gathered_rows, "gathered"))
        todo = [t for t in todo if t[1] is None or not t[0].holds(t[1], t[2])]
        plans = [None if spec is None else getattr(plan, field) for _, spec, _, field in todo]
        for (layout, _, n, _), p in zip(todo, plans, strict=True):
            layout.check_fits(p, n)  # all before any write: a refusal leaves every buffer
        for (layout, spec, n, _), p in zip(todo, plans, strict=True):
            layout.write(p, n, spec)
        gathered = None if buffers.gathered is None else buffers.gathered.view(gathered_rows)
        if not local:
            self._set(None, None, gathered)
            return
        self._set(LoRABatchInfo(buffers.tokens.view(rows)), buffers.logits.view(requests),
                  gathered)
