"""The prologue every LoRA kernel program shares: its block's slot and rows."""

import triton
import triton.language as tl


@triton.jit
def load_block(perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, blk, BLOCK_M: tl.constexpr):
    """(slot, rows, row_mask, empty) of block ``blk``; rows are int64 row indices of the input.
    Empty blocks (start == end) load nothing: every row is masked."""
    slot = tl.load(blk_slot_ptr + blk)
    start = tl.load(blk_start_ptr + blk)
    end = tl.load(blk_end_ptr + blk)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, rows, m_mask, start >= end


@triton.jit
def load_rank(rank_ptr, max_rank):
    """A slot's rank in one slice, read from its ranks-table entry and clamped to
    ``0..max_rank``: an entry past ``max_rank`` (a table set by hand) read A rows of the next
    slice or slot and wrote ``a`` columns past its slice, past the output row at the last
    slice (heap corruption); a negative one counts as rank 0, as in the torch reference."""
    return clamp_rank(tl.load(rank_ptr), max_rank)


@triton.jit
def clamp_rank(rank, max_rank):
    """Ranks-table values (a scalar or a vector) clamped to ``0..max_rank``."""
    return tl.minimum(tl.maximum(rank, 0), max_rank)
