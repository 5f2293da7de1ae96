"""A decode batch written into a graph's static input buffers in one launch.

Row ``i < n`` takes the batch's token id, position, cache slot, context length and KV-slot
row (entries past the batch's table width set to the scratch slot, across the whole static
row); rows ``n..bucket-1`` become padding (token 0 at position 0, writing and attending to
the scratch slot alone, length 1). The same as six to ten small copies and fills, each a
launch and a gap between a decode step's replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check
from kernels.fast_launch import launch


# The batch's size and table width change every step: specialising on them would compile
# variants mid-serving.
@triton.jit(do_not_specialize=["src_row_stride", "width", "n"])
def _write_decode_inputs_kernel(
    ids_src, pos_src, loc_src, lens_src, table_src, src_row_stride, width, n,
    ids_dst, pos_dst, loc_dst, lens_dst, table_dst, dst_row_stride, max_context,
    SCRATCH: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    live = row < n
    src = tl.where(live, row, 0)  # padding rows read row 0 (of the destination when idle)
    tl.store(ids_dst + row, tl.where(live, tl.load(ids_src + src), 0))
    tl.store(pos_dst + row, tl.where(live, tl.load(pos_src + src), 0))
    tl.store(loc_dst + row, tl.where(live, tl.load(loc_src + src), SCRATCH))
    tl.store(lens_dst + row, tl.where(live, tl.load(lens_src + src), 1))
    src_row = table_src + src.to(tl.int64) * src_row_stride
    dst_row = table_dst + row.to(tl.int64) * dst_row_stride
    copied = tl.where(live, width, 0)
    for c0 in range(0, max_context, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < max_context
        v = tl.load(src_row + cols, mask=inside & (cols < copied), other=SCRATCH)
        tl.store(dst_row + cols, v, mask=inside)


def write_decode_inputs(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...] | None,
                        bucket: int, scratch: int) -> None:
    """``dst``: the static ``(input_ids, positions, out_cache_loc, kv_lens, kv_indices)``,
    int64, ``kv_indices`` ``[rows, max_context]`` with contiguous rows; ``src``: the batch's
    same five (``kv_indices`` ``[n, width]``, ``width <= max_context``), None for an idle
    batch. Writes rows ``0..bucket-1`` of ``dst``."""
    ids, pos, loc, lens, table = dst
    n = 0 if src is None else src[0].shape[0]
    max_rows, max_context = table.shape
    check(n <= bucket <= max_rows, lambda: f"a batch of {n} rows does not fit bucket {bucket} "
          f"of buffers holding {max_rows}: pick a bucket of at least {n} rows")
    check(all(t.dtype == torch.int64 for t in dst), "write_decode_inputs writes int64 buffers")
    if src is not None:  # narrower integer indices are exact in int64; nothing else is taken
        src = tuple(t if t.dtype == torch.int64 else _widened(t) for t in src)
    check(table.stride(1) == 1 and (src is None or src[4].stride(1) == 1),
          "kv_indices rows must be contiguous")
    check(all(t.numel() <= 1 or t.stride(0) == 1 for t in dst[:4] + (src or ())[:4]),
          "ids, positions, cache slots and lengths must be contiguous vectors")
    if src is not None:
        width = src[4].shape[1]
        check(width <= max_context, lambda: f"the batch's KV table is {width} wide; the "
              f"buffers hold {max_context}: capture the decode graphs with a larger max_context")
        check(all(t.shape[0] == n for t in src), "the batch's tensors differ in rows")
    if n == 0:  # a batch of no rows too: the kernel reads row 0 of src (empty: out of bounds)
        src, width = dst, 0  # never read: every row is padding
    if bucket == 0:
        return
    launch(_write_decode_inputs_kernel, (bucket,),
        src[0], src[1], src[2], src[3], src[4], src[4].stride(0), width, n,
        ids, pos, loc, lens, table, table.stride(0), max_context,
        SCRATCH=scratch, BLOCK=min(1024, triton.next_power_of_2(max_context)),
    )


def _widened(t: torch.Tensor) -> torch.Tensor:
    check(t.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8),
          lambda: f"write_decode_inputs takes integer index tensors, got {t.dtype}")
    return t.long()
