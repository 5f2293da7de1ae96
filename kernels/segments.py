"""Which rows belong to which adapter slot: the per-batch layout every LoRA kernel reads.

Rows are grouped by slot through a permutation (a stable sort of requests by slot), the groups
("segments") are cut into blocks of at most ``block_m`` rows, and each kernel program handles
one block. Kernels read only device tensors; the grid is the length of the block table, never a
per-batch count, so a layout that lives in static buffers can be replayed inside a CUDA graph.

Invariant: every block holds rows of exactly one slot, and unused blocks are empty
(``start == end``) and point at the neutral slot, whose ranks are zero in every module.
"""

from __future__ import annotations

import array
import itertools
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SegmentPlan:
    """Host-side layout of one batch, built before anything touches the device."""

    token_slots: list[int]
    permutation: list[int]
    seg_bounds: list[int]
    seg_slots: list[int]
    blocks: list[tuple[int, int, int]]
    block_m: int
    arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False,
                                                         compare=False, repr=False)
    """``(token_slots, permutation)`` as int64 arrays where ``plan_segments`` built them:
    ``_pack`` copies them at memory speed (converting 2,048 Python ints costs ~40 us on the
    H200 host). Not an init field, so ``dataclasses.replace`` never carries stale ones."""

    @property
    def num_rows(self) -> int:
        return len(self.token_slots)

    def row_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.arrays is not None:
            return self.arrays
        return (np.asarray(self.token_slots, dtype=np.int64),
                np.asarray(self.permutation, dtype=np.int64))


def max_blocks(num_rows: int, block_m: int, num_segments: int) -> int:
    """Upper bound on blocks for ``num_rows`` rows split into at most ``num_segments`` groups:
    a block holds at least one row, so never more than the rows. (Without that cap a decode
    graph of one row with 64 slots launched every LoRA kernel over 66 blocks, 65 of them
    empty.)"""
    return min(num_rows, -(-num_rows // block_m) + num_segments)


def plan_segments(
    request_slots: Sequence[int],
    request_lens: Sequence[int] | None = None,
    *,
    block_m: int,
    skip_slot: int | None = None,
) -> SegmentPlan:
    """Group the rows of consecutive requests by slot.

    ``request_lens[i]`` rows belong to request ``i`` (one row each when omitted: a decode batch).
    Rows of ``skip_slot`` (the neutral slot) are kept in the permutation but get no block.
    """
    block_m = check_block_m(block_m)
    if request_lens is None:  # decode: one row a request, at most a few hundred
        plan = _plan_rows(_whole_slots(request_slots), block_m, skip_slot)
    else:
        plan = _plan_requests(request_slots, request_lens, block_m, skip_slot)
    if plan.seg_slots and plan.seg_slots[0] < 0:  # segments come in ascending slot order
        raise ValueError(f"request slot {plan.seg_slots[0]} is negative: slots are 0.. (the "
                         "pool's slots, then its neutral slot)")
    return plan


def check_block_m(block_m) -> int:
    """``block_m`` as a Python int. Every LoRA kernel spans a block's rows with
    ``tl.arange(0, block_m)``: a power of two (another one planned fine, then failed inside
    the kernel's compilation), a Python int (a numpy one failed there too: "arange's
    arguments must be of type tl.constexpr")."""
    whole = isinstance(block_m, numbers.Integral) and not isinstance(block_m, bool)
    if not whole or block_m <= 0 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a positive power of two (the LoRA kernels' row "
                         f"blocks: 16 decode, 64 extend), got {block_m!r}")
    return int(block_m)


def _whole_slots(request_slots: Sequence[int]) -> list[int]:
    """The slots as Python ints; ``int()`` had truncated a slot of 0.7 to slot 0."""
    out = []
    for s in request_slots:
        try:
            out.append(operator.index(s))
        except TypeError:
            raise ValueError(f"request_slots must be integers (slot numbers), got "
                             f"{type(s).__name__} {s!r:.40}") from None
    return out


def _whole_size(name: str, value) -> int:
    """A size or slot number as a Python int (a float one failed in torch.zeros naming its
    "size", a bool one became the views' ``max_slot``)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"StaticSegmentLayout: {name} must be an integer, got "
                         f"{type(value).__name__} {value!r:.40}")
    return int(value)


def _whole_array(values: Sequence[int], name: str) -> np.ndarray:
    """``values`` as a flat int64 array; a float or bool one is refused (numpy's cast had
    truncated a length of 2.5 to 2 rows)."""
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got {a.dtype} values "
                         f"({a.reshape(-1)[:4].tolist()!r:.60})")
    return a.astype(np.int64, copy=False).reshape(-1)


def _plan_rows(slots: list[int], block_m: int, skip_slot: int | None) -> SegmentPlan:
    """Decode: plain Python (numpy's per-call cost loses below a few hundred rows); this runs
    whenever a decode batch changes, so no per-row Python beyond the sort."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    seg_bounds, seg_slots, blocks = [0], [], []
    for slot, group in itertools.groupby(slots[i] for i in order):
        lo = seg_bounds[-1]
        hi = lo + sum(1 for _ in group)
        seg_slots.append(slot)
        seg_bounds.append(hi)
        if slot != skip_slot:
            blocks += [(slot, b, min(b + block_m, hi)) for b in range(lo, hi, block_m)]
    return SegmentPlan(slots, order, seg_bounds, seg_slots, blocks, block_m)


def _plan_requests(request_slots: Sequence[int], request_lens: Sequence[int], block_m: int,
                   skip_slot: int | None) -> SegmentPlan:
    """Prefill: vectorised, a step plans thousands of rows (Python loops over them cost
    ~1 ms on the H200 host, on the critical path of every LoRA extend step)."""
    slots = _whole_array(request_slots, "request_slots")
    lens = _whole_array(request_lens, "request_lens")
    if len(lens) != len(slots):
        raise ValueError(
            f"request_lens has {len(lens)} entries but request_slots has {len(slots)}"
        )
    if len(lens) and lens.min() < 0:
        raise ValueError(f"request length must be >= 0, got {lens.min()}")
    order = np.argsort(slots, kind="stable")
    token_slots = np.repeat(slots, lens)
    # Row r of the permuted order is row (r - its request's first permuted row) of that
    # request, counted from the request's first row in batch order.
    sorted_slots, sorted_lens = slots[order], lens[order]
    firsts = np.cumsum(lens) - lens
    permuted_firsts = np.cumsum(sorted_lens) - sorted_lens
    permutation = np.arange(int(lens.sum())) - np.repeat(permuted_firsts - firsts[order],
                                                          sorted_lens)
    # Segments: runs of one slot in the permuted order (requests of no rows add none).
    live = sorted_lens > 0
    run_slots, run_lens = sorted_slots[live], sorted_lens[live]
    new_run = np.ones(len(run_slots), dtype=bool)
    new_run[1:] = run_slots[1:] != run_slots[:-1]
    seg_slots = run_slots[new_run].tolist()
    run_ends = np.append(new_run[1:], True)
    seg_bounds = [0, *np.cumsum(run_lens)[run_ends].tolist()] if len(run_slots) else [0]
    blocks = []
    for slot, lo, hi in zip(seg_slots, seg_bounds, seg_bounds[1:], strict=False):
        if slot != skip_slot:
            blocks += [(slot, b, min(b + block_m, hi)) for b in range(lo, hi, block_m)]
    plan = SegmentPlan(token_slots.tolist(), permutation.tolist(), seg_bounds, seg_slots, blocks,
                       block_m)
    object.__setattr__(plan, "arrays", (token_slots, permutation))  # frozen: set once, here
    return plan


@dataclass(frozen=True)
class SegmentSpec:
    """What ``plan_segments`` is called with. Equal specs plan equal layouts, so a static
    layout that already holds a spec's plan skips its refresh (consecutive decode steps of an
    unchanged batch: no planning, no copy)."""

    request_slots: tuple[int, ...]
    request_lens: tuple[int, ...] | None
    block_m: int
    skip_slot: int | None

    @property
    def num_rows(self) -> int:
        return len(self.request_slots) if self.request_lens is None else sum(self.request_lens)

    def plan(self) -> SegmentPlan:
        return plan_segments(self.request_slots, self.request_lens, block_m=self.block_m,
                             skip_slot=self.skip_slot)


@dataclass
class SegmentLayout:
    """Device view of a plan. All five tensors are int32 views of one buffer."""

    token_slots: torch.Tensor
    permutation: torch.Tensor
    block_slots: torch.Tensor
    block_starts: torch.Tensor
    block_ends: torch.Tensor
    block_m: int
    max_slot: int | None = None
    """The largest slot any row or block may name, known on the host (the plan's, or a static
    layout's neutral slot): launchers refuse it past the weights' neutral slot
    (``kernels.checks.check_layout``). None for a layout built by hand from tensors: not
    checked."""
    checked_on: torch.device | None = field(default=None, compare=False, repr=False)
    """Set by ``kernels.checks.check_layout`` once the five tensors passed its checks there
    (their dtype, device and contiguity never change: the buffer is never replaced)."""

    @property
    def num_rows(self) -> int:
        return self.token_slots.shape[0]

    @staticmethod
    def from_plan(plan: SegmentPlan, device: torch.device | str) -> SegmentLayout:
        """Exact-size layout for an eager forward (one host-to-device copy)."""
        return SegmentLayout.from_plans([plan], device)[0]

    @staticmethod
    def from_plans(plans: list[SegmentPlan], device: torch.device | str) -> list[SegmentLayout]:
        """Exact-size layouts of several plans (an eager forward's token rows, logits rows,
        gathered rows) in one buffer, moved by one host-to-device copy. On CUDA the copy is
        from pinned memory and does not block: a copy from pageable memory waits for the
        stream first, which held every eager step's host work until the previous step's
        kernels had run."""
        # Each part starts 16-byte aligned: Triton specialises kernels on pointer alignment,
        # so offsets that moved with the batch's row count compiled new variants mid-serving.
        # One Python list, converted once: numpy slice assignments per part cost ~1 us each.
        values: list[int] = []
        parts = []
        for plan in plans:
            block_columns = tuple(zip(*plan.blocks, strict=True)) if plan.blocks else ((), (), ())
            for column in (plan.token_slots, plan.permutation, *block_columns):
                parts.append((len(values), len(column)))
                values += column
                values += _PAD[: -len(column) % _ALIGN]
        host = torch.frombuffer(array.array("i", values or _PAD), dtype=torch.int32)
        device = torch.device(device)
        pinned = device.type == "cuda"
        if pinned:
            host = host.pin_memory()
        # Hazard: ``host`` is freed on return while the copy may be pending; torch's pinned
        # allocator records the copy's stream and reuses the block only after it ran.
        buf = host.to(device, non_blocking=pinned)
        views = [buf[o : o + n] for o, n in parts]
        return [SegmentLayout(*views[5 * i : 5 * i + 5], block_m=plan.block_m,
                              max_slot=_max_slot(plan))
                for i, plan in enumerate(plans)]


def _max_slot(plan: SegmentPlan) -> int:
    """The plan's largest slot (-1: no rows). From its segments, which ``plan_segments``
    makes in ascending slot order, and every row and block is of one."""
    slots = plan.seg_slots
    if not slots:
        return -1
    if slots[0] < 0:  # a plan built by hand: ``plan_segments`` refuses them
        raise ValueError(f"the plan names slot {slots[0]}: slots are 0.. (the pool's slots, "
                         "then its neutral slot)")
    return slots[-1]


_ALIGN = 4  # int32 entries in 16 bytes
_PAD = [0] * _ALIGN


def _pack(plan: SegmentPlan | None, rows: int, blocks: int, neutral_slot: int,
          out: np.ndarray | None = None) -> np.ndarray:
    """The five parts back to back (slots, permutation, block slots, starts, ends), each
    padded to ``rows`` or ``blocks`` entries (neutral slot, identity rows, empty blocks);
    written into ``out`` when given."""
    n = 0 if plan is None else plan.num_rows
    used = 0 if plan is None else len(plan.blocks)
    if n > rows or used > blocks:
        raise ValueError(
            f"batch needs {n} rows and {used} blocks but the layout holds {rows} and {blocks}"
        )
    out = np.empty(2 * rows + 3 * blocks, dtype=np.int32) if out is None else out
    slots, perm, tab = out[:rows], out[rows : 2 * rows], out[2 * rows :].reshape(3, blocks)
    if n:
        slots[:n], perm[:n] = plan.row_arrays()
    if used:
        tab[:, :used] = np.asarray(plan.blocks, dtype=np.int32).T
    slots[n:] = neutral_slot
    perm[n:] = np.arange(n, rows, dtype=np.int32)
    tab[0, used:] = neutral_slot
    tab[1:, used:] = 0
    return out


class StaticSegmentLayout:
    """Capacity-sized layout whose tensors never move: what a captured graph reads.

    ``view(rows)`` gives the layout a graph of ``rows`` rows is captured with; ``write`` refreshes
    the contents in place before a replay. Rows and blocks the batch does not use are set to
    the neutral slot (rank 0 everywhere) and empty blocks, so nothing reads a previous batch.
    """

    def __init__(
        self, max_rows: int, num_slots: int, block_m: int, neutral_slot: int, device
    ) -> None:
        block_m = check_block_m(block_m)
        max_rows, num_slots, neutral_slot = (
            _whole_size(name, value) for name, value in
            (("max_rows", max_rows), ("num_slots", num_slots), ("neutral_slot", neutral_slot)))
        if max_rows < 0:  # torch.zeros named a "dimension size", not the argument
            raise ValueError(f"max_rows must be >= 0 (the rows of the largest batch), got "
                             f"{max_rows}")
        if not 0 <= neutral_slot < num_slots:
            raise ValueError(f"neutral_slot={neutral_slot} must be one of the {num_slots} slots "
                             f"0..{num_slots - 1} (num_slots counts the neutral one)")
        self.max_rows, self.num_slots = max_rows, num_slots
        self.block_m, self.neutral_slot = block_m, neutral_slot
        cap = max_blocks(max_rows, block_m, num_slots)
        self._buf = torch.zeros(2 * max_rows + 3 * cap, dtype=torch.int32, device=device)
        # Host side of the refresh: pinned, so the copy is one asynchronous DMA.
        self._staging = torch.zeros(self._buf.shape, dtype=torch.int32,
                                    pin_memory=self._buf.is_cuda)
        self._copied = torch.cuda.Event() if self._buf.is_cuda else None
        self._views: dict[int, SegmentLayout] = {}
        self._held: tuple[SegmentSpec, int, int] | None = None
        self.write(None, max_rows)

    def blocks_for(self, rows: int) -> int:
        return max_blocks(rows, self.block_m, self.num_slots)

    def view(self, rows: int) -> SegmentLayout:
        """The same object for the same ``rows`` (the buffer never moves)."""
        if rows not in self._views:
            self._views[rows] = self._make_view(rows)
        return self._views[rows]

    def _make_view(self, rows: int) -> SegmentLayout:
        self._check_rows(rows)
        nb = self.blocks_for(rows)
        sizes = [rows, rows, nb, nb, nb]
        offsets = [0, self.max_rows, 2 * self.max_rows]
        offsets += [offsets[2] + k * self.blocks_for(self.max_rows) for k in (1, 2)]
        parts = [self._buf[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
        # ``write`` keeps every slot at or below the neutral one (the last row of the tables).
        return SegmentLayout(*parts, block_m=self.block_m, max_slot=self.neutral_slot)

    def holds(self, spec: SegmentSpec, rows: int) -> bool:
        """The buffer already holds ``spec``'s plan and it fits the ``rows``-row view."""
        held = self._held
        return (held is not None and held[0] == spec and held[1] <= rows
                and held[2] <= self.blocks_for(rows))

    def write(self, plan: SegmentPlan | None, rows: int,
              spec: SegmentSpec | None = None) -> None:
        """Copy ``plan`` (None: an idle batch) into the first ``rows`` rows, neutral elsewhere.
        ``spec``: what ``plan`` was planned from, remembered for ``holds`` (without it the
        buffer holds no known spec)."""
        self.check_fits(plan, rows)
        cap_rows, cap_blocks = self.max_rows, self.blocks_for(self.max_rows)
        if self._copied is not None:
            # Hazard: the last asynchronous copy may still be reading the staging buffer.
            self._copied.synchronize()
        _pack(plan, cap_rows, cap_blocks, self.neutral_slot, out=self._staging.numpy())
        self._buf.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            # On the buffer's device's stream, where the copy ran (the current device's
            # stream, another GPU's, would let the next write refill the staging mid-copy).
            self._copied.record(torch.cuda.current_stream(self._buf.device))
        # Invariant: _held names the buffer's contents or is None (nothing else writes it).
        self._held = None if spec is None or plan is None else (
            spec, plan.num_rows, len(plan.blocks))

    def check_fits(self, plan: SegmentPlan | None, rows: int) -> None:
        """Raises where ``write(plan, rows)`` would refuse, writing nothing (a caller that
        refreshes several layouts checks them all before the first write)."""
        self._check_rows(rows)
        if plan is not None and plan.block_m != self.block_m:
            raise ValueError(f"plan has block_m={plan.block_m}, layout needs {self.block_m}")
        if plan is not None and _max_slot(plan) > self.neutral_slot:
            raise ValueError(f"plan names slot {_max_slot(plan)} but this layout's slots are "
                             f"0..{self.neutral_slot} (its neutral slot last)")
        if plan is not None and (plan.num_rows > rows or len(plan.blocks) > self.blocks_for(rows)):
            raise ValueError(
                f"batch needs {plan.num_rows} rows and {len(plan.blocks)} blocks but the "
                f"{rows}-row view holds {rows} and {self.blocks_for(rows)}"
            )

    def _check_rows(self, rows: int) -> None:
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"rows={rows} is outside this layout's capacity 0..{self.max_rows}")
