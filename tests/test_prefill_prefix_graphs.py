"""Prefill graphs with cached prefixes (issue 7: continuations, chunked prefill).

Requests whose KV already holds a prefix are extended (``build_extend`` on requests with
``kv_slots``), with prefixes from zero to beyond the prefill graphs' ``max_prefix``, few and
many new tokens, up to more requests than a bucket holds. Every batch runs eagerly and, when a
bucket takes it, as a replay of the smallest bucket that holds all its tokens: the replay
equals eager for every request (nothing truncated). A batch no bucket holds whole (too many
tokens, requests or cached tokens) must be refused by every bucket and run eagerly. One or two
requests per batch are checked against the merged dense model of their adapter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from graph_harness import MAX_PREFIX, MAX_REQUESTS, PREFILL_BUCKETS, shared
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_runtime.engine.requests import Request, build_extend, release

TARGETS_A = ["q_proj", "v_proj", "down_proj", "lm_head"]
TARGETS_B = ["k_proj", "o_proj", "gate_proj", "up_proj", "embed_tokens"]


def _world(backend):
    h = shared(backend, DEVICE).reset()
    h.ads = {None: None, "A": h.adapter("A", 4, TARGETS_A, seed=21),
             "B": h.adapter("B", 2, TARGETS_B, seed=22, alpha=5.0)}
    return h


def _expected(n_reqs: int, prefix: int, tokens: int) -> int | None:
    if n_reqs > MAX_REQUESTS or prefix > MAX_PREFIX:
        return None
    return next((b for b in PREFILL_BUCKETS if b >= tokens), None)


def _extend(h, reqs, g, new_lens, check=(0,)):
    """Appends ``new_lens[i]`` random tokens to request i, extends them all in one batch
    (eager, then the replay its bucket takes, if any) and checks requests ``check`` against
    the oracle. Returns the bucket used."""
    prefix = sum(len(r.kv_slots) for r in reqs)
    for r, k in zip(reqs, new_lens, strict=True):
        r.prompt += torch.randint(0, h.config.vocab_size, (k,), generator=g).tolist()
    want = _expected(len(reqs), prefix, sum(new_lens))
    logits = h.step(build_extend(reqs, h.runner.kv, DEVICE), expect_bucket=want)
    for i in check:
        h.oracle(reqs[i].tokens, h.ads[reqs[i].adapter], logits[i])
    return want


def _requests(h, spec):
    return [Request([int(h.config.vocab_size) - 1 - i], a, 4) for i, a in enumerate(spec)]


@settings(max_examples=8, deadline=None, database=None)
@given(data=st.data(), n=st.integers(1, MAX_REQUESTS + 1), rounds=st.integers(1, 3),
       seed=st.integers(0, 2**20))
def test_prefix_extends_replay_like_eager_torch(data, n, rounds, seed):
    """Each request: a 1-token prompt prefilled eagerly, then ``rounds`` extensions of random
    sizes in one batch each (prefix totals from 1 to well past MAX_PREFIX)."""
    h = _world("torch")
    g = torch.Generator().manual_seed(seed)
    reqs = _requests(h, data.draw(st.lists(st.sampled_from([None, "A", "B"]), min_size=n,
                                           max_size=n)))
    h.runner.forward_eager(build_extend(reqs, h.runner.kv, DEVICE))
    hi = data.draw(st.sampled_from([3, 24, 60]))  # few or many new tokens per request
    for _ in range(rounds):
        lens = data.draw(st.lists(st.integers(1, hi), min_size=n, max_size=n))
        check = sorted({0, data.draw(st.integers(0, n - 1))})
        _extend(h, reqs, g, lens, check)
    release(reqs, h.runner.kv)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_up_to_and_past_max_prefix(backend):
    """Requests prefilled in chunks (continuations of the same requests): prefix 0, 15, 30
    (replays in the 16- and 80-token buckets), then 95 cached tokens (> MAX_PREFIX: eager);
    then fresh requests with exactly MAX_PREFIX cached tokens (a replay) and one more (eager).
    """
    h = _world(backend)
    g = torch.Generator().manual_seed(3)
    reqs = [Request([1], "A", 4), Request([2], None, 4), Request([3], "B", 4)]
    assert _extend(h, reqs, g, [9, 2, 1], check=(0,)) == 16         # prefix 0, 15 new
    assert _extend(h, reqs, g, [12, 1, 2], check=(0, 2)) == 16      # prefix 15, 15 new
    assert _extend(h, reqs, g, [40, 20, 5], check=(0, 1)) == 80     # prefix 30, 65 new
    assert _extend(h, reqs, g, [2, 3, 4], check=(0, 2)) is None     # prefix 95
    fresh = [Request([7] * 20, "A", 4), Request([8] * 28, "B", 4)]
    h.runner.forward_eager(build_extend(fresh, h.runner.kv, DEVICE))  # prefix 48 == MAX_PREFIX
    assert _extend(h, fresh, g, [9, 8], check=(0, 1)) == 80         # 17 new tokens
    more = [Request([9] * 25, "A", 4), Request([10] * 24, None, 4)]
    h.runner.forward_eager(build_extend(more, h.runner.kv, DEVICE))  # prefix 49
    assert _extend(h, more, g, [1, 1], check=(0,)) is None
    release(reqs + fresh + more, h.runner.kv)
