"""Graph buckets that span several metadata blocks (issue 7, "Test strength").

Decode buckets above DECODE_BLOCK_M=16 rows and prefill buckets above EXTEND_BLOCK_M=64
tokens, so every bucket has its own block-table size (graph_harness: 5, 6 and 8 blocks), and
batches whose block count exceeds the smallest bucket's table. Deterministic batches
(adapters interleaved, requests without adapter, sizes just below/at/above block and bucket
boundaries, one above every bucket); every replay equals eager, the static metadata the graph
read equals the eager layout and is neutral past the batch, and one request per batch equals
the merged dense model. Triton (the point of it) and torch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU
from graph_harness import DECODE_BUCKETS, MAX_REQUESTS, PREFILL_BUCKETS, shared

from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.batch_info import DECODE_BLOCK_M, EXTEND_BLOCK_M

SMALLEST_TABLE = 5  # ceil(1 / 16) + SLOTS + 1 blocks
# The Triton interpreter is slow on CPU: a subset there, every size on torch and on the GPU.
DECODE_SIZES = [1, 8, 15, 16, 17, 24, 25, 33, 51, 56, 57]
DECODE_SIZES_INTERP = [17, 56, 57]
# (adapter per request, tokens per request); totals 15, 16, 17, 64, 65, 80, 81, 144, 208, 209.
PREFILL_BATCHES = [
    ("AN", [7, 8]),
    ("ABC", [5, 5, 6]),
    ("NAB", [1, 8, 8]),
    ("ABCN", [16, 16, 16, 16]),
    ("A", [65]),
    ("ABNCA", [20, 17, 3, 30, 10]),
    ("BNA", [64, 1, 16]),
    ("CAB", [65, 65, 14]),
    ("ABCN", [65, 65, 66, 12]),
    ("ABCN", [65, 65, 66, 13]),
    ("NNN", [3, 4, 5]),
]
PREFILL_INTERP = [2, 6, 8, 9]


@pytest.fixture(params=["triton", "torch"])
def h(request):
    h = shared(request.param, DEVICE).reset()
    h.ads = {"A": h.adapter("A", 4, ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
                            seed=1),
             "B": h.adapter("B", 8, ["k_proj", "gate_proj", "up_proj", "embed_tokens"], seed=2,
                            alpha=3.0),
             "C": h.adapter("C", 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj", "embed_tokens", "lm_head"],
                            seed=3),
             "N": None}
    return h


def _interp(h) -> bool:
    return h.backend == "triton" and not ON_GPU


def _names(pattern: str) -> list[str | None]:
    return [None if c == "N" else c for c in pattern]


def _expected(buckets: list[int], size: int) -> int | None:
    return next((b for b in buckets if b >= size), None)


def _blocks(names, lens, block_m: int) -> int:
    return sum(-(-sum(k for n, k in zip(names, lens, strict=True) if n == a) // block_m)
               for a in "ABC")


def _decode_pattern(n: int) -> list[str | None]:
    """A B C A B C ... with no adapter every 11th request: the first 56 requests hold 17 rows
    of each adapter (6 blocks, more than the smallest bucket's table)."""
    out, k = [], 0
    for i in range(n):
        if i % 11 == 10:
            out.append(None)
        else:
            out.append("ABC"[k % 3])
            k += 1
    return out


def test_decode_buckets_with_several_blocks(h):
    kv, g = h.runner.kv, torch.Generator().manual_seed(0)
    sizes = DECODE_SIZES_INTERP if _interp(h) else DECODE_SIZES
    pool = [Request(torch.randint(0, h.config.vocab_size, (2,), generator=g).tolist(), n, 64)
            for n in _decode_pattern(max(sizes))]
    logits = h.runner.forward_eager(build_extend(pool, kv, DEVICE))
    for r, row in zip(pool, logits, strict=True):
        r.output.append(int(row.argmax()))
    most_blocks = 0
    for i, n in enumerate(sizes):
        reqs = pool[:n]
        logits = h.step(build_decode(reqs, kv, DEVICE), expect_bucket=_expected(DECODE_BUCKETS, n))
        if n <= DECODE_BUCKETS[-1]:
            most_blocks = max(most_blocks, _blocks([r.adapter for r in reqs], [1] * n,
                                                   DECODE_BLOCK_M))
        j = (7 * i + 5) % n
        h.oracle(reqs[j].tokens, h.ads[reqs[j].adapter or "N"], logits[j])
        for r, row in zip(reqs, logits, strict=True):
            r.output.append(int(row.argmax()))
    # A base-only batch replays its bucket's graph without LoRA.
    h.step(build_decode([r for r in pool if r.adapter is None], kv, DEVICE), expect_bucket=24)
    release(pool, kv)
    assert most_blocks > SMALLEST_TABLE, "a replayed batch must outgrow the smallest table"


def test_prefill_buckets_with_several_blocks(h):
    kv, g = h.runner.kv, torch.Generator().manual_seed(1)
    batches = PREFILL_BATCHES
    if _interp(h):
        batches = [batches[i] for i in PREFILL_INTERP]
    most_blocks, eager_only = 0, h.eager_only
    for i, (pattern, lens) in enumerate(batches):
        assert len(lens) <= MAX_REQUESTS
        reqs = [Request(torch.randint(0, h.config.vocab_size, (k,), generator=g).tolist(), n, 4)
                for n, k in zip(_names(pattern), lens, strict=True)]
        total = sum(lens)
        logits = h.step(build_extend(reqs, kv, DEVICE),
                        expect_bucket=_expected(PREFILL_BUCKETS, total))
        if total <= PREFILL_BUCKETS[-1]:
            most_blocks = max(most_blocks, _blocks(pattern, lens, EXTEND_BLOCK_M))
        j = i % len(reqs)
        h.oracle(reqs[j].tokens, h.ads[pattern[j]], logits[j])
        release(reqs, kv)
    assert most_blocks > SMALLEST_TABLE, "a replayed batch must outgrow the smallest table"
    assert h.eager_only == eager_only + 1  # 209 tokens: above every bucket, runs eagerly
