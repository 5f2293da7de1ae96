"""LoRA-A for token embeddings is a gather: ``a[row, :r] = A_emb[slot, token_id[row], :r]``
(``A_emb`` stores PEFT's ``lora_embedding_A`` transposed, so one row is contiguous).
Its output has the shrink kernel's shape and feeds ``lora_expand``.

Token ids outside ``[0, vocab)``: on CPU tensors they are refused (a ``ValueError`` naming
them, in eager calls and traced replays alike). On a GPU, refusing them would need a device
sync a launch: there the kernel masks them, so their rows read nothing and their ``a`` is zero
(the LoRA term adds nothing). The engine refuses such prompts when they are added
(``Engine.add_request``), and the base embedding asserts on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import config
from kernels.block_rows import load_block, load_rank
from kernels.checks import check, check_layout, check_weight_tables
from kernels.fast_launch import launch
from kernels.segments import SegmentLayout
from kernels.traced_op import traced_op
from kernels.weights import LoRAWeights


@triton.jit
def _embedding_gather_kernel(
    ids_ptr, a_ptr, out_ptr, perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr, ranks_ptr,
    vocab, max_rank, stride_as, stride_av, stride_ar, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    blk = tl.program_id(0)
    slot, rows, m_mask, empty = load_block(perm_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr,
                                           blk, BLOCK_M)
    rank = load_rank(ranks_ptr + slot, max_rank)
    if (rank == 0) | empty:
        return
    ids = tl.load(ids_ptr + rows, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask = m_mask[:, None] & (offs_r < rank)[None, :]
    # Ids outside the vocabulary read nothing: their rows of ``a`` are stored as zeros.
    known = (ids >= 0) & (ids < vocab)
    a = tl.load(
        a_ptr + slot.to(tl.int64) * stride_as + ids[:, None] * stride_av
        + offs_r[None, :] * stride_ar,
        mask=mask & known[:, None], other=0.0,
    )
    tl.store(out_ptr + rows[:, None] * stride_om + offs_r[None, :] * stride_or,
             a.to(tl.float32), mask=mask)


@traced_op("multilora::embedding_gather", mutates_args=())
def _embedding_op(
    token_ids: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor,
    permutation: torch.Tensor, block_slots: torch.Tensor, block_starts: torch.Tensor,
    block_ends: torch.Tensor, block_m: int,
) -> torch.Tensor:
    vocab = lora_a.shape[1]
    if token_ids.device.type == "cpu" and token_ids.shape[0]:  # no device sync on CPU
        lo, hi = (int(v) for v in torch.aminmax(token_ids))
        check(lo >= 0 and hi < vocab, lambda: "lora_embedding_shrink: token_ids "
              f"{[t for t in token_ids.tolist() if not 0 <= t < vocab][:5]} are outside the "
              f"vocabulary 0..{vocab - 1}. Refuse such ids before the forward (the engine "
              "refuses such prompts in add_request)")
    return _gather(token_ids, lora_a, ranks, permutation, block_slots, block_starts, block_ends,
                   block_m)


def _gather(token_ids, lora_a, ranks, permutation, block_slots, block_starts, block_ends,
            block_m) -> torch.Tensor:
    """The kernel's launch: ids outside the vocabulary give rows of zeros."""
    t = token_ids.shape[0]
    max_rank = lora_a.shape[2]
    out = torch.empty(t, max_rank, dtype=torch.float32, device=token_ids.device)
    if t == 0 or block_slots.shape[0] == 0:
        return out
    launch(_embedding_gather_kernel, (block_slots.shape[0],),
        token_ids, lora_a, out, permutation, block_slots, block_starts, block_ends, ranks,
        lora_a.shape[1], max_rank, *lora_a.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_R=config.rank_block(max_rank),
    )
    return out


@_embedding_op.register_fake
def _(token_ids, lora_a, ranks, permutation, block_slots, block_starts, block_ends, block_m):
    return token_ids.new_empty(token_ids.shape[0], lora_a.shape[2], dtype=torch.float32)


def lora_embedding_shrink(
    token_ids: torch.Tensor, weights: LoRAWeights, layout: SegmentLayout | None
) -> torch.Tensor:
    """fp32 ``[rows, max_rank]``, defined where the column is below the slot's rank."""
    # Before the layout's row count: 2-D ids are not stale metadata.
    check(token_ids.dim() == 1, lambda: f"token_ids must be 1-D (one id a row), got shape "
          f"{tuple(token_ids.shape)}")
    check_layout(layout, token_ids.shape[0], token_ids.device, "lora_embedding_shrink",
                 weights.lora_a.shape[0])
    check(weights.is_embedding, "lora_embedding_shrink needs weights from "
          "LoRAWeights.for_embedding")
    check(token_ids.dtype in (torch.int32, torch.int64) and token_ids.is_contiguous(),
          lambda: f"token_ids must be contiguous int32/int64, got {token_ids.dtype}")
    check(weights.lora_a.device == token_ids.device,
          lambda: f"lora_a is on {weights.lora_a.device} but token_ids is on {token_ids.device}")
    check_weight_tables(weights, 1, token_ids.device)
    return _embedding_op(
        token_ids, weights.lora_a, weights.ranks, layout.permutation, layout.block_slots,
        layout.block_starts, layout.block_ends, layout.block_m,
    )
