"""What each host-path benchmark checks once, so it can never time a broken path: the built
batch holds its requests' rows, a LoRA layout groups every adapter row into blocks of its own
slot (checked from its meaning, not against the planner's output), the static buffers hold
the batch and are neutral past it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.requests import Request


class HostCheckError(AssertionError):
    pass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise HostCheckError(message)


def check_decode_batch(batch: ForwardBatch, reqs: Sequence[Request]) -> None:
    """One row per request: its last token, at its position, over its cached context."""
    _require(batch.mode is ForwardMode.DECODE, f"built a {batch.mode.value} batch, not decode")
    _require(batch.batch_size == len(reqs),
             f"batch has {batch.batch_size} rows for {len(reqs)} requests")
    _require(batch.adapter_names == tuple(r.adapter for r in reqs), "adapters out of order")
    _require(batch.input_ids.tolist() == [r.tokens[-1] for r in reqs],
             "input ids are not each request's last token")
    _require(batch.positions.tolist() == [len(r.tokens) - 1 for r in reqs],
             "positions are not each request's last position")
    _require(batch.out_cache_loc.tolist() == [r.kv_slots[-1] for r in reqs],
             "the new tokens' KV slots are not the slots the requests took")
    lens = batch.attn.kv_lens.tolist()
    _require(lens == [len(r.kv_slots) for r in reqs], "KV lengths differ from the requests'")
    table = batch.attn.kv_indices.tolist()
    for i, r in enumerate(reqs):
        _require(table[i][: lens[i]] == r.kv_slots, f"row {i}: KV indices are not its slots")


def check_layout(token_slots: Sequence[int], permutation: Sequence[int],
                 blocks: Sequence[tuple[int, int, int]], want_slots: Sequence[int],
                 neutral: int, block_m: int, what: str) -> None:
    """``want_slots[i]`` is row i's slot. Rows past them (capacity padding) must be neutral;
    ``blocks`` may end in empty neutral blocks (unused capacity)."""
    n = len(want_slots)
    _require(list(token_slots[:n]) == list(want_slots), f"{what}: row slots differ from the "
             "batch's adapters")
    _require(all(s == neutral for s in token_slots[n:]),
             f"{what}: rows past the batch do not select the neutral slot")
    _require(sorted(permutation) == list(range(len(token_slots))),
             f"{what}: the row order is not a permutation")
    covered = []
    for k, (slot, start, end) in enumerate(blocks):
        if start == end:
            _require(slot == neutral, f"{what}: empty block {k} does not select the neutral slot")
            continue
        _require(0 <= start < end <= n and end - start <= block_m,
                 f"{what}: block {k} spans rows {start}..{end} of {n} (block_m {block_m})")
        _require(slot != neutral, f"{what}: block {k} runs the neutral slot")
        rows = [permutation[i] for i in range(start, end)]
        _require(all(want_slots[r] == slot for r in rows),
                 f"{what}: block {k} (slot {slot}) holds rows of other slots")
        covered += rows
    adapter_rows = [i for i, s in enumerate(want_slots) if s != neutral]
    _require(sorted(covered) == adapter_rows,
             f"{what}: blocks cover rows {sorted(covered)[:8]}..., not each adapter row once")


def _blocks(layout) -> list[tuple[int, int, int]]:
    return list(zip(layout.block_slots.tolist(), layout.block_starts.tolist(),
                    layout.block_ends.tolist(), strict=True))


def check_plan(plan, want_slots: Sequence[int], neutral: int, what: str) -> None:
    """A host ``SegmentPlan`` of exactly the batch's rows."""
    _require(plan.num_rows == len(want_slots), f"{what}: plan has {plan.num_rows} rows")
    check_layout(plan.token_slots, plan.permutation, plan.blocks, want_slots, neutral,
                 plan.block_m, what)


def check_device_layout(layout, want_slots: Sequence[int], neutral: int, what: str) -> None:
    """A device ``SegmentLayout`` (exact size, or a static one's full capacity)."""
    check_layout(layout.token_slots.tolist(), layout.permutation.tolist(), _blocks(layout),
                 want_slots, neutral, layout.block_m, what)


def check_static_layout(static, want_slots: Sequence[int], neutral: int, what: str) -> None:
    """A ``StaticSegmentLayout`` as a graph reads it: the batch, then neutral capacity.
    (Reading it back is ordered after the refresh's asynchronous copy: same stream.)"""
    check_device_layout(static.view(static.max_rows), want_slots, neutral, what)


def check_input_buffers(buffers, batch: ForwardBatch, bucket: int) -> None:
    """The decode graph's input buffers hold ``batch``, padding rows harmless past it."""
    n = batch.batch_size
    for name, pad in (("input_ids", 0), ("positions", 0), ("out_cache_loc", KVCache.SCRATCH)):
        got = getattr(buffers, name)[:bucket].tolist()
        _require(got[:n] == getattr(batch, name).tolist(), f"static {name} differ from the batch")
        _require(all(v == pad for v in got[n:]), f"static {name} past the batch are not {pad}")
    lens = buffers.kv_lens[:bucket].tolist()
    _require(lens[:n] == batch.attn.kv_lens.tolist() and all(v == 1 for v in lens[n:]),
             "static kv_lens differ from the batch or are not 1 past it")
    c = batch.attn.kv_indices.shape[1]
    _require(torch.equal(buffers.kv_indices[:n, :c], batch.attn.kv_indices),
             "static KV indices differ from the batch")
