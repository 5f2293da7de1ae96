"""Guarded LoRA layers: each wraps a base layer and adds its LoRA term only while
``lora_active`` (``set_lora and backend.batch_info is not None``, contract 2).

Gating on ``set_lora`` alone would run LoRA in an idle forward with no (or stale) metadata.
MLP layers read the MLP's layout (``RowSet.GATHERED``): under DP attention it covers every
rank's rows and is set on an idle rank too, whose own layout stays None.
Without tensor parallelism, column- and row-parallel wrappers compute the same thing; they
stay distinct types so a module map reads like a serving engine's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import LoRAWeights
from lora_runtime.lora.backends import LoRABackend, RowSet


class LoRALayer(nn.Module):
    rows = RowSet.TOKENS

    def __init__(self, base: nn.Module, backend: LoRABackend, weights: LoRAWeights) -> None:
        super().__init__()
        self.base = base
        self.backend = backend
        self.lora = weights
        self.set_lora = True

    @property
    def lora_active(self) -> bool:
        return self.set_lora and self.backend.layout_ready(self.rows)


class LinearWithLoRA(LoRALayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_active:
            y = self._one_launch(x)
            return y if y is not None else self._split(x)
        return self._base_call()(x)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """Base + LoRA as shrink and expand around the GEMM (one launch already ruled out)."""
        return self.backend.linear_split(self._base_call(), x.contiguous(), self.lora,
                                         self.rows)

    def _base_call(self):
        """The base layer as a function: ``F.linear`` on its parameters for a plain
        ``nn.Linear`` (``Module.__call__`` and ``__getattr__`` cost 1-10 us each on a slow
        host, x 34 wrappers a forward), so a base-only or idle eager forward costs no more
        module calls than a model without LoRA. Read from the registries, which stay current:
        a base swapped in after wrapping (a quantized layer) runs as itself."""
        base = self._modules["base"]
        if type(base) is not nn.Linear:
            return base
        params = base._parameters
        return lambda x: F.linear(x, params["weight"], params["bias"])

    def _one_launch(self, x: torch.Tensor):
        """The output with the LoRA term added in one launch after the GEMM where the backend
        does that for ``x`` (eager, few rows: host-bound, ``backend.one_launch``), else None.
        Checked first: the delta and deferred routes are for graph captures and more rows."""
        if self.backend.one_launch(x, self.lora, self.rows):
            return self.backend.linear_one_launch(self._base_call(), x.contiguous(), self.lora,
                                                  self.rows)
        return None

    def _routed(self, x: torch.Tensor, consumer: str, delta_route: str):
        """``(output, term or None)`` by the routes every consumer shares, in order: the whole
        term left to ``consumer`` (``_unshrunk``), one launch (``_one_launch``), the term beside
        the GEMM (``_delta_beside``); None where none applies."""
        out = self._unshrunk(x, consumer)
        if out is None:
            y = self._one_launch(x)
            out = None if y is None else (y, None)
        return out if out is not None else self._delta_beside(x, delta_route)

    def _unshrunk(self, x: torch.Tensor, consumer: str):
        """``(output, UnshrunkLoRA)`` where the backend leaves the whole LoRA term to
        ``consumer`` (eager, few rows: no LoRA launch; ``backend.shrinks_in_consumer``), else
        None. Checked before the one-launch route, which still launches."""
        if self.backend.shrinks_in_consumer(x, self.lora, consumer, self.rows):
            return self.backend.linear_unshrunk(self._base_call(), x.contiguous(), self.lora,
                                                self.rows)
        return None

    def _delta_beside(self, x: torch.Tensor, route: str):
        """``(output, LoRADelta)`` where the backend computes the LoRA term beside the GEMM
        for the consumer to add (``backend.expand_beside``, by ``route``: a key of
        ``config.DELTA_MAX_ROWS``), else None."""
        if self.backend.expand_beside(x, route):
            return self.backend.linear_delta(self._base_call(), x.contiguous(), self.lora,
                                             self.rows)
        return None


class ColumnLinearWithLoRA(LinearWithLoRA):
    pass


class DeferredExpandLinear(LinearWithLoRA):
    """A projection whose next kernel (``consumer``) can add its LoRA term to the rows it
    loads (``kernels.lora_epilogue``, ``kernels.row_lora``): the model calls
    ``forward_deferred``."""

    consumer: str
    delta_route: str | None = None
    """This projection's key of ``config.DELTA_MAX_ROWS`` (None: its consumer's)."""

    def forward_deferred(self, x: torch.Tensor):
        """``(output, UnshrunkLoRA or PendingLoRA or LoRADelta or None)``: where the backend
        leaves the whole term to the consumer (``backend.shrinks_in_consumer``) it comes
        unshrunk, where it computes the term beside the GEMM (``backend.expand_beside``) as a
        delta, where it leaves the expand to the consumer (``backend.fuses_expand``) as a
        pending term, for the consumer to add; otherwise it is already in the output."""
        if self.lora_active:
            out = self._routed(x, self.consumer, self.delta_route or self.consumer)
            if out is not None:
                return out
            if self.backend.fuses_expand(x, self.lora, self.consumer):
                return self.backend.linear_deferred(self._base_call(), x.contiguous(),
                                                    self.lora, self.rows)
            return self._split(x), None
        return self._base_call()(x), None


class RowLinearWithLoRA(DeferredExpandLinear):
    """o_proj. Its output goes to the residual add + RMSNorm, which may add its LoRA term."""

    consumer = "norm"


class MLPRowLinearWithLoRA(RowLinearWithLoRA):
    """down_proj: runs on the MLP's rows. Under DP it is row-parallel: A holds this rank's
    input columns and B is whole, so the partial LoRA term is added before the
    reduce-scatter that sums the base layer's partial outputs, and is summed with them."""

    rows = RowSet.GATHERED
    # Its GEMM (K = intermediate) is ~3.5x o_proj's: the two routes are measured apart.
    delta_route = "down"


class QKVLinearWithLoRA(DeferredExpandLinear):
    """Fused q, k, v: three slices of unequal width (GQA), each with its own rank/scaling.
    RoPE with the KV write may add its LoRA term."""

    consumer = "rope"


class MergedColumnLinearWithLoRA(DeferredExpandLinear):
    """Fused gate, up: two slices of equal width, on the MLP's rows. Under DP it is
    column-parallel: A is whole and B holds this rank's output rows of each slice. SwiGLU's
    activation may add its LoRA term."""

    rows = RowSet.GATHERED
    consumer = "silu_mul"


class LMHeadWithLoRA(LinearWithLoRA):
    """lm_head runs on the logits rows (one per request), so it reads the lm_head pass."""

    rows = RowSet.LOGITS


class VocabEmbeddingWithLoRA(LoRALayer):
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        y = self._modules["base"](token_ids)
        if self.lora_active:
            self.backend.run_embedding(token_ids, y, self.lora)
        return y


WRAPPERS = {
    "embed_tokens": VocabEmbeddingWithLoRA,
    "qkv_proj": QKVLinearWithLoRA,
    "o_proj": RowLinearWithLoRA,
    "gate_up_proj": MergedColumnLinearWithLoRA,
    "down_proj": MLPRowLinearWithLoRA,
    "lm_head": LMHeadWithLoRA,
}
