"""Stacked adapter weights of one module: one row per pool slot, plus per-slot rank and scaling.

Slot ``num_slots`` (the last row of ``ranks``/``scalings``) is the neutral slot: rank 0 in every
slice, never written. Rows of requests without an adapter, padding rows and unused blocks point
at it, and every kernel exits on rank 0 before it reads weights, so no weight row exists for it.
Ranks and scalings are per slice: an adapter may target q_proj and v_proj but not k_proj, or
give slices different ranks (PEFT ``rank_pattern``); slice s of a slot uses rows
``[s * max_rank, s * max_rank + ranks[slot, s])`` of ``lora_a``.

Hazard: kernels read a slot's B columns up to ``max_rank``, not its rank (a bound the compiler
can vectorize), and multiply the ones past the rank by an ``a`` that is zero there. Those
columns must hold finite values (0 * inf is NaN): the allocation and every slot write
(``SlotWriter``) zero them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class LoRAWeights:
    lora_a: torch.Tensor
    """Linear: [num_slots, num_slices * max_rank, in_features].
    Embedding: [num_slots, vocab, max_rank]."""
    lora_b: torch.Tensor
    """[num_slots, out_features, max_rank]; slice s owns output columns slice_bounds[s]:[s+1]."""
    ranks: torch.Tensor
    """int32 [num_slots + 1, num_slices]."""
    scalings: torch.Tensor
    """float32 [num_slots + 1, num_slices]."""
    slice_offsets: torch.Tensor
    """int32 [num_slices + 1] on the device: output column where each slice starts."""
    slice_bounds: tuple[int, ...]
    max_rank: int
    is_embedding: bool = False
    tables_checked: tuple | None = field(default=None, compare=False, repr=False)
    """``(device, ranks, scalings)`` once ``kernels.checks.check_weight_tables`` passed them
    there (fixed buffers that the slot pool writes in place: checked once, not per launch)."""
    shrink_checked: tuple | None = field(default=None, compare=False, repr=False)
    """``(lora_a, x dtype, x device, x columns)`` once ``check_shrink_args`` passed them: what
    depends on the weights alone is checked once per input signature, not per launch."""
    expand_checked: tuple | None = field(default=None, compare=False, repr=False)
    """``(lora_b, y dtype, y device)``, the same for ``check_expand_args``."""
    one_launch_checked: tuple | None = field(default=None, compare=False, repr=False)
    """``(tensors held, signature, launch arguments)`` of the last signature
    ``kernels.shrink_expand.lora_shrink_expand`` checked in full."""
    unshrunk_checked: tuple | None = field(default=None, compare=False, repr=False)
    """``(row_constants, signature, launch arguments, neutral slot)`` of the input/output
    signature ``kernels.row_lora.UnshrunkLoRA.check`` passed in full (a term a consumer
    computes from the input); a layout's slots are compared with the neutral slot each time."""
    block_constants: tuple | None = field(default=None, compare=False, repr=False)
    """What a by-blocks consumer takes of these weights and a layout (``kernels.row_lora.
    block_args``), kept for the last layout and input signature."""
    row_constants: tuple | None = field(default=None, compare=False, repr=False)
    """What a by-rows consumer kernel takes of these weights (``kernels.row_lora``), built
    once: a launch's strides and tables cost host time at every eager step."""

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[0]

    @property
    def neutral_slot(self) -> int:
        return self.num_slots

    @property
    def num_slices(self) -> int:
        return len(self.slice_bounds) - 1

    @cached_property
    def slice_widths(self) -> tuple[int, ...]:
        b = self.slice_bounds
        return tuple(b[i + 1] - b[i] for i in range(len(b) - 1))

    @cached_property
    def column_align(self) -> int:
        """The largest power of two, at most 16, dividing every slice bound: kernels that mask
        a slice's output columns tell the compiler (``tl.multiple_of``) so their accesses of
        the output vectorize."""
        g = math.gcd(*self.slice_bounds)
        return min(16, g & -g)

    @staticmethod
    def for_linear(
        num_slots: int,
        in_features: int,
        slice_widths: Sequence[int],
        max_rank: int,
        dtype: torch.dtype,
        device,
    ) -> LoRAWeights:
        num_slots, max_rank, slice_widths = _check_sizes(num_slots, max_rank, slice_widths)
        in_features = _whole("in_features", in_features)
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        s = len(slice_widths)
        a = torch.zeros(num_slots, s * max_rank, in_features, dtype=dtype, device=device)
        b = torch.zeros(num_slots, sum(slice_widths), max_rank, dtype=dtype, device=device)
        return LoRAWeights(a, b, *_tables(num_slots, slice_widths, device), max_rank)

    @staticmethod
    def for_embedding(
        num_slots: int, vocab_size: int, hidden_size: int, max_rank: int, dtype, device
    ) -> LoRAWeights:
        num_slots, max_rank, (hidden_size,) = _check_sizes(num_slots, max_rank, [hidden_size])
        vocab_size = _whole("vocab_size", vocab_size)
        if vocab_size < 1:  # torch.zeros named a "dimension size", not the argument
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        a = torch.zeros(num_slots, vocab_size, max_rank, dtype=dtype, device=device)
        b = torch.zeros(num_slots, hidden_size, max_rank, dtype=dtype, device=device)
        return LoRAWeights(
            a, b, *_tables(num_slots, [hidden_size], device), max_rank, is_embedding=True
        )


def _check_sizes(num_slots, max_rank, slice_widths) -> tuple[int, int, list[int]]:
    """The sizes as Python ints: a numpy max_rank (``np.max`` of ranks) was kept and failed
    the first launch ("'numpy.int64' object has no attribute 'bit_length'")."""
    num_slots, max_rank = _whole("num_slots", num_slots), _whole("max_rank", max_rank)
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if max_rank < 1:
        raise ValueError(f"max_rank must be >= 1, got {max_rank}")
    widths = [_whole("slice widths", w, list(slice_widths)) for w in slice_widths]
    if not widths or any(w <= 0 for w in widths):
        raise ValueError(f"slice widths must be positive, got {widths}")
    return num_slots, max_rank, widths


def _whole(name: str, value, shown=None) -> int:
    """``value`` as a Python int (numpy's and 0-d integer tensors taken), or an error naming
    ``name`` where it is no integer (``shown``: the sequence holding it, named instead)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        what = "an integer" if shown is None else "integers"
        raise ValueError(f"{name} must be {what}, got "
                         f"{value if shown is None else shown!r}") from None


def _tables(num_slots: int, slice_widths: Sequence[int], device):
    s = len(slice_widths)
    ranks = torch.zeros(num_slots + 1, s, dtype=torch.int32, device=device)
    scalings = torch.zeros(num_slots + 1, s, dtype=torch.float32, device=device)
    bounds = [0]
    for w in slice_widths:
        bounds.append(bounds[-1] + int(w))
    offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    return ranks, scalings, offsets, tuple(bounds)
