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

from lora_runtime.checks import is_int

if TYPE_CHECKING:
    from lora_runtime.dp.group import DPGroup
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


def check_gathered(batch: ForwardBatch, dp: DPGroup | None) -> None:
    """Raises ValueError, naming what differs, where ``batch.gathered`` cannot describe the
    rows a model sharded over ``dp`` gathers for its MLP (``dp`` None: an unsharded model, for
    which gathered is None or a group of one: this rank's rows). A host check, before any
    LoRA state or collective. Without it a sharded forward failed in its first MLP on
    ``None.rows_per_rank`` (after attention, on this rank alone: its peers waited in the
    all-gather), and a layout whose rows of this rank were not the batch's (other adapters or
    lengths) gave the MLP's LoRA to the wrong rows, silently."""
    g = batch.gathered
    name, size, rank = ("an unsharded model", 1, 0) if dp is None else (dp.name, dp.size,
                                                                         dp.rank)
    if g is None:
        if dp is None:
            return
        raise ValueError(f"{name}: the model's MLP is sharded and runs on every rank's rows, "
                         "but batch.gathered is None: set it to the step's GatheredRows, agreed "
                         "by every rank (DPEngine does), or run an unsharded model")
    if g.mode not in (ForwardMode.DECODE, ForwardMode.EXTEND):
        raise ValueError(f"{name}: gathered.mode is {g.mode}; a step gathers DECODE or EXTEND "
                         "rows (EXTEND when the ranks' modes differ)")
    if g.mode is ForwardMode.DECODE and batch.mode is ForwardMode.EXTEND:
        raise ValueError(f"{name}: an extend batch in a step whose gathered.mode is DECODE: a "
                         "step that mixes modes gathers EXTEND rows")
    if not is_int(g.rows_per_rank) or g.rows_per_rank < 0:
        raise ValueError(f"{name}: gathered.rows_per_rank must be an integer >= 0, got "
                         f"{g.rows_per_rank!r}")
    if len(g.adapters) != size or len(g.lens) != size:
        raise ValueError(f"{name}: gathered describes {len(g.adapters)} ranks' adapters and "
                         f"{len(g.lens)} ranks' lengths; the MLP gathers {size} ranks' rows"
                         + (" (shard it with lora_runtime.dp.shard.shard_mlp)" if dp is None
                            else ""))
    for r, (names, lens) in enumerate(zip(g.adapters, g.lens, strict=True)):
        if len(names) != len(lens):
            raise ValueError(f"{name}: gathered gives rank {r} {len(names)} adapters for "
                             f"{len(lens)} requests' lengths")
        if sum(lens) > g.rows_per_rank:
            raise ValueError(f"{name}: gathered gives rank {r} {sum(lens)} rows, more than "
                             f"its rows_per_rank {g.rows_per_rank}")
    mine = (tuple(g.adapters[rank]), tuple(g.lens[rank]))
    if mine != (tuple(batch.adapter_names), tuple(batch.extend_lens)):
        raise ValueError(f"{name}: gathered's rows of this rank (adapters {mine[0]}, lengths "
                         f"{mine[1]}) are not the batch's (adapters {batch.adapter_names}, "
                         f"lengths {batch.extend_lens}): the MLP's LoRA would serve other rows. "
                         "Build gathered from the same step as the batch")
