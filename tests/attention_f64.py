"""Float64 ground truth for attention over the token-slot KV cache, written row by row from
the definition: a request's j-th new token attends to the first ``prefix + j + 1`` keys of its
context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestRows:
    rows: list[int]
    """Rows of the packed queries holding this request's new tokens, in order."""
    context: list[int]
    """KV-cache slots of its whole context (prefix, then the new tokens)."""


def attention_f64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  requests: list[RequestRows], scale: float) -> torch.Tensor:
    """``[T, heads, head_dim]`` float64 on the CPU; rows of no request are zero."""
    t, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for req in requests:
        prefix = len(req.context) - len(req.rows)
        slots = torch.tensor(req.context, dtype=torch.long)
        k = k_cache.cpu()[slots].double().repeat_interleave(group, dim=1)  # [C, H, D]
        v = v_cache.cpu()[slots].double().repeat_interleave(group, dim=1)
        for j, row in enumerate(req.rows):
            n = prefix + j + 1
            scores = torch.einsum("hd,nhd->hn", q[row].cpu().double(), k[:n]) * scale
            out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[:n])
    return out
