"""``ForwardBatch``: the tensors one model forward reads, and the host facts LoRA needs.

Modes: EXTEND (prefill: new tokens of each request, possibly after a cached prefix), DECODE
(one token per request), IDLE (no local tokens: a data-parallel rank whose peers have work).
Building an IDLE batch resets the LoRA batch (contract 3): an idle forward must never run
with the previous batch's metadata.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lora_runtime.lora.manager import LoRAManager


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"


@dataclass
class DecodeAttention:
    kv_indices: torch.Tensor
    """[bs, ctx] int64: KV-cache slots of each request's context (the new token included);
    entries past ``kv_lens`` point at the scratch slot 0."""
    kv_lens: torch.Tensor
    """[bs] int64."""


@dataclass
class ExtendAttention:
    token_req: torch.Tensor
    """[T] int64: which request each new token belongs to (padding: -1)."""
    kv_indices: torch.Tensor
    """[C] int64: every request's context, packed (padding: scratch slot 0)."""
    kv_req: torch.Tensor
    """[C] int64 (padding: -1, so padding tokens see padding keys and no NaN appears)."""
    kv_pos: torch.Tensor
    """[C] int64: position of each key within its request."""
    q_starts: torch.Tensor
    """[R+1] int32, cumulative: request i's new tokens are rows q_starts[i]..q_starts[i+1]
    (rows past q_starts[-1] belong to no request)."""
    kv_starts: torch.Tensor
    """[R+1] int32, cumulative: request i's context is kv_indices[kv_starts[i]..kv_starts[i+1]]
    (key j at position j; the new tokens are its last q_starts[i+1] - q_starts[i] keys)."""


@dataclass(frozen=True)
class GatheredRows:
    """Data-parallel attention: the MLP runs on the rows of every rank, gathered rank after
    rank, each rank's padded to ``rows_per_rank``. Agreed by all ranks before the step."""

    mode: ForwardMode
    """The step's mode on every non-idle rank (DECODE or EXTEND; eager steps may mix them,
    then EXTEND)."""
    rows_per_rank: int
    adapters: tuple[tuple[str | None, ...], ...]
    """Per rank, per request: its adapter (None: the base model)."""
    lens: tuple[tuple[int, ...], ...]
    """Per rank, per request: its rows in this step."""

    @property
    def has_adapters(self) -> bool:
        return any(a is not None for rank in self.adapters for a in rank)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    logits_rows: torch.Tensor
    """[bs] int64: rows whose hidden state reaches lm_head (the last token of each request)."""
    attn: DecodeAttention | ExtendAttention
    adapter_names: tuple[str | None, ...] = ()
    """Per request; None: the base model."""
    extend_lens: tuple[int, ...] = ()
    """Token rows per request (1 each in decode)."""
    gathered: GatheredRows | None = None
    """Set under data-parallel attention (the MLP's gathered layout)."""

    @property
    def batch_size(self) -> int:
        return len(self.adapter_names)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def has_adapters(self) -> bool:
        return any(n is not None for n in self.adapter_names)

    def __post_init__(self) -> None:
        if len(self.extend_lens) != len(self.adapter_names):
            raise ValueError(f"extend_lens has {len(self.extend_lens)} entries for "
                             f"{len(self.adapter_names)} requests")
        if sum(self.extend_lens) != self.num_tokens:
            raise ValueError(f"extend_lens sum to {sum(self.extend_lens)} but the batch has "
                             f"{self.num_tokens} tokens")
        if self.mode is ForwardMode.DECODE and any(n != 1 for n in self.extend_lens):
            raise ValueError("a decode batch has exactly one token per request")

    @staticmethod
    def idle(lora_manager: LoRAManager | None, device,
             gathered: GatheredRows | None = None) -> ForwardBatch:
        """An empty batch. Resets the LoRA batch state: nothing may read the previous one.
        Under DP, ``gathered`` describes the other ranks' rows its MLP still serves."""
        if lora_manager is not None:
            lora_manager.reset_lora_batch()
        empty = torch.empty(0, dtype=torch.long, device=device)
        return ForwardBatch(
            ForwardMode.IDLE, empty, empty, empty, empty,
            DecodeAttention(torch.empty(0, 1, dtype=torch.long, device=device), empty),
            gathered=gathered,
        )
