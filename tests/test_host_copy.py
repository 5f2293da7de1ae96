"""A step's batch tensors built on the host and moved in one copy (``host_copy.to_device``,
``build_extend``, ``build_decode``): every field against a plain per-request construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_runtime.engine.host_copy import ALIGN, to_device
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.model.config import tiny

CFG = tiny()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([np.int64, np.int32]),
                          st.lists(st.integers(0, 5), min_size=1, max_size=2)), max_size=6),
       st.integers(0, 2**31 - 1))
def test_arrays_arrive_whole_typed_and_aligned(specs, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(-2**30, 2**30, size=shape).astype(dtype) for dtype, shape in specs]
    got = to_device(arrays, DEVICE)
    for a, t in zip(arrays, got, strict=True):
        assert t.device.type == DEVICE.type and t.is_contiguous()
        assert t.dtype == (torch.int64 if a.dtype == np.int64 else torch.int32)
        assert t.data_ptr() % ALIGN == 0, "each part starts 16-byte aligned"
        np.testing.assert_array_equal(t.cpu().numpy(), a)
    with pytest.raises(TypeError, match="int64 and int32"):
        to_device([np.zeros(3, dtype=np.float32)], DEVICE)


def _reference_extend(reqs, prefixes, lens):
    """Each field of an extend batch, request by request, in plain Python."""
    ids, pos, loc, token_req, kv, kv_req, kv_pos = [], [], [], [], [], [], []
    for i, (r, p, n) in enumerate(zip(reqs, prefixes, lens, strict=True)):
        ids += r.tokens[p : p + n]
        pos += range(p, p + n)
        loc += list(r.kv_slots)[p : p + n]
        token_req += [i] * n
        kv += list(r.kv_slots)
        kv_req += [i] * len(r.kv_slots)
        kv_pos += range(len(r.kv_slots))
    return ids, pos, loc, token_req, kv, kv_req, kv_pos


def test_extend_and_decode_fields_match_a_per_request_construction():
    kv = KVCache(CFG, 256, torch.float32, DEVICE)
    kv.alloc(7)  # the cache's free list no longer starts at slot 1
    reqs = [Request(list(range(10, 19)), "a"), Request([3, 4], None), Request([5] * 6, "b")]
    for rs, prefixes, lens, limits in ((reqs, [0, 0, 0], [4, 2, 6], [4, 2, 6]),  # 0 chunked
                                       (reqs[:1], [4], [5], None)):  # its continuation
        batch = build_extend(rs, kv, DEVICE, limits=limits)
        ids, pos, loc, token_req, kvi, kv_req, kv_pos = _reference_extend(rs, prefixes, lens)
        a = batch.attn
        for t, want in ((batch.input_ids, ids), (batch.positions, pos),
                        (batch.out_cache_loc, loc), (a.token_req, token_req),
                        (a.kv_indices, kvi), (a.kv_req, kv_req), (a.kv_pos, kv_pos),
                        (batch.logits_rows, list(np.cumsum(lens) - 1)),
                        (a.q_starts, [0, *np.cumsum(lens)]),
                        (a.kv_starts, [0, *np.cumsum([len(r.kv_slots) for r in rs])])):
            assert t.cpu().tolist() == [int(x) for x in want]
        assert batch.extend_lens == tuple(lens)
        assert a.q_starts.dtype == a.kv_starts.dtype == torch.int32
    for r in reqs:
        r.output.append(1)
    dec = build_decode(reqs, kv, DEVICE)
    width = max(len(r.kv_slots) for r in reqs)
    assert dec.attn.kv_indices.shape == (3, width)
    for i, r in enumerate(reqs):
        row = dec.attn.kv_indices[i].cpu().tolist()
        assert row == list(r.kv_slots) + [KVCache.SCRATCH] * (width - len(r.kv_slots))
    assert dec.input_ids.cpu().tolist() == [1, 1, 1]
    assert dec.positions.cpu().tolist() == [len(r.kv_slots) - 1 for r in reqs]
    assert dec.out_cache_loc.cpu().tolist() == [r.kv_slots[-1] for r in reqs]
    assert dec.attn.kv_lens.cpu().tolist() == [len(r.kv_slots) for r in reqs]
    release(reqs, kv)
