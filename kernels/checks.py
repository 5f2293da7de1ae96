"""Argument checks shared by the launchers. Each message names the input and the fix."""

from __future__ import annotations

import numbers

import torch

from kernels.config import interpreted
from kernels.segments import SegmentLayout
from kernels.weights import LoRAWeights

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(cond: bool, msg) -> None:
    """``msg``: the text, or a function making it (the launchers' f-strings cost more than
    their checks when built on every call)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def is_whole(value) -> bool:
    """An integer (numpy's too); not a bool, not a float of integral value."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def checked_override(name: str, value, least: int = 1) -> int | None:
    """A launch override as a Python int (numpy's taken), None where not given; refused
    unless a power of two >= ``least``. Overrides were rounded or dropped silently (tiles=3
    ran as 2, block_n=-16 added nothing, 0 meant the heuristic) or failed in the kernel."""
    if value is None:
        return None
    ok = is_whole(value) and value >= least and value & (value - 1) == 0
    check(ok, lambda: f"{name} must be a power of two >= {least}, got {value!r}")
    return int(value)


def check_dtype(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, lambda: f"{name} has dtype {t.dtype}; expected fp16, bf16 or "
          f"fp32")
    check(
        not (interpreted() and t.dtype == torch.bfloat16),
        lambda: f"{name} is bf16 but TRITON_INTERPRET=1: the interpreter computes tl.dot on bf16 "
        f"wrongly. Use fp16/fp32 on CPU, or the torch backend",
    )


def check_q_and_kv_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The attention launchers' common checks: ``q`` ``[rows, heads, head_dim]`` (checked 3-D
    by the caller) with a contiguous head_dim, the caches ``[slots, kv_heads, head_dim]`` in
    its dtype and on its device, heads a multiple of kv_heads. Returns kv_heads."""
    heads, head_dim = q.shape[1], q.shape[2]
    check_dtype("q", q)
    check(q.stride(2) == 1, lambda: f"q must have a contiguous head_dim, got strides {q.stride()}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(c.dim() == 3 and c.shape[2] == head_dim and c.stride(2) == 1,
              lambda: f"{name} must be [slots, kv_heads, {head_dim}] with contiguous head_dim, got "
              f"shape {tuple(c.shape)} strides {c.stride()}")
        check(c.dtype == q.dtype and c.device == q.device,
              lambda: f"{name} is {c.dtype} on {c.device} but q is {q.dtype} on {q.device}; keep "
              f"the KV cache in the model dtype")
    check(k_cache.shape == v_cache.shape, lambda: f"k_cache {tuple(k_cache.shape)} and v_cache "
          f"{tuple(v_cache.shape)} differ")
    kv_heads = k_cache.shape[1]
    check(heads % kv_heads == 0, lambda: f"q has {heads} heads, not a multiple of the cache's "
          f"{kv_heads} KV heads")
    return kv_heads


def check_layout(layout: SegmentLayout | None, rows: int, device: torch.device, what: str,
                 neutral_slot: int) -> None:
    """``neutral_slot``: the weights' (``LoRAWeights.neutral_slot``, ``lora_a.shape[0]``); a
    layout naming a slot past it would read ranks, scalings and weights past their ends."""
    check(
        layout is not None,
        lambda: f"{what}: no LoRA batch is prepared. Call "
        f"LoRAManager.prepare_lora_batch(forward_batch)"
        " before the forward, or skip LoRA when backend.batch_info is None",
    )
    check(
        layout.num_rows == rows,
        lambda: f"{what}: the prepared LoRA metadata covers {layout.num_rows} rows but the input "
        f"has {rows}. The metadata is stale: prepare (or reset) the LoRA batch for this forward",
    )
    # Per launch: a layout may serve pools of other sizes. One naming a slot past the neutral
    # one would read the weights' tables and weights past their ends.
    top = layout.max_slot
    if top is not None and top > neutral_slot:
        raise ValueError(f"{what}: the layout names slot {top} but the weights have slots "
                         f"0..{neutral_slot - 1} and the neutral slot {neutral_slot}. Plan the "
                         "layout from this pool's slots (is it another pool's layout?)")
    if layout.checked_on == device:
        return
    for name in ("token_slots", "permutation", "block_slots", "block_starts", "block_ends"):
        t = getattr(layout, name)
        check(
            t.dtype == torch.int32 and t.device == device and t.is_contiguous(),
            lambda: f"{what}: layout.{name} must be contiguous int32 on {device}, got {t.dtype} on "
            f"{t.device}",
        )
    layout.checked_on = device


def check_rows_disjoint(name: str, t: torch.Tensor) -> None:
    """2-D ``t``'s elements are distinct memory: a kernel that adds into ``t`` in place would
    race on elements that share it (an ``expand()``-ed view, a row stride below the width).
    Depends on the rows (one row of any row stride is fine), so not cached with a signature
    that does not fix them; callers on a hot path test the usual case first (contiguous
    columns, rows a row apart or one row)."""
    (n0, n1), (s0, s1) = t.shape, t.stride()
    dims = sorted((s, n) for s, n in ((s0, n0), (s1, n1)) if n > 1)
    # Disjoint (a sufficient condition): the inner stride at least 1, the outer
    # one past the inner dimension's extent.
    ok = not dims or (dims[0][0] >= 1 and (len(dims) == 1 or dims[1][0] >= dims[0][0] * dims[0][1]))
    check(ok, lambda: f"{name} has overlapping elements (shape {tuple(t.shape)}, strides "
          f"{(s0, s1)}: an expand()-ed or as_strided view?); the kernel adds into {name} in "
          f"place, so elements sharing memory race. Pass a contiguous tensor ({name}.contiguous(), "
          "copied back after)")


def check_weight_tables(weights: LoRAWeights, num_slices: int, device: torch.device) -> None:
    """``check_tables`` of ``weights``' ranks and scalings, skipped once they passed on
    ``device`` (an eager LoRA launch's checks cost as much host time as its arguments)."""
    seen = weights.tables_checked
    if (seen is not None and seen[0] == device and seen[1] is weights.ranks
            and seen[2] is weights.scalings):
        return
    check_tables(weights.ranks, weights.scalings, weights.num_slots, num_slices, device)
    weights.tables_checked = (device, weights.ranks, weights.scalings)


def check_tables(weights_ranks: torch.Tensor, scalings: torch.Tensor | None, num_slots: int,
                 num_slices: int, device: torch.device) -> None:
    want = (num_slots + 1, num_slices)
    check(
        weights_ranks.dtype == torch.int32 and tuple(weights_ranks.shape) == want,
        lambda: f"ranks must be int32 of shape {want} (slots + neutral slot, slices), got "
        f"{weights_ranks.dtype} {tuple(weights_ranks.shape)}",
    )
    check(weights_ranks.device == device, lambda: f"ranks is on {weights_ranks.device}, expected "
          f"{device}")
    check_contiguous_table("ranks", weights_ranks)
    if scalings is not None:
        check(
            scalings.dtype == torch.float32 and tuple(scalings.shape) == want,
            lambda: f"scalings must be float32 of shape {want}, got {scalings.dtype} "
            f"{tuple(scalings.shape)}",
        )
        check(scalings.device == device, lambda: f"scalings is on {scalings.device}, expected "
              f"{device}")
        check_contiguous_table("scalings", scalings)


def check_contiguous_table(name: str, table: torch.Tensor) -> None:
    """Kernels read entry (slot, slice) at ``slot * slices + slice``: a table of another
    memory layout (a transposed or strided view) read other slots' entries, silently."""
    check(table.is_contiguous(), lambda: f"{name} must be contiguous (the kernels index it "
          f"row-major), got strides {table.stride()}; pass {name}.contiguous()")
