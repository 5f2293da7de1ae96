"""The one-launch decode buffer write (``kernels.decode_inputs``, the GPU path of
``DecodeBuffers.write``) leaves the static buffers exactly as the torch path does, whatever
they held before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphs.static_batch import DecodeBuffers
from kernels.decode_inputs import write_decode_inputs
from lora_runtime.engine.forward_batch import DecodeAttention, ForwardBatch, ForwardMode
from lora_runtime.engine.kv_cache import KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUCKETS = [1, 2, 4, 8]
MAX_CONTEXT = 40


def _batch(rng: np.random.Generator, n: int, width: int, padded: int) -> ForwardBatch:
    """``n`` decode rows whose KV table is ``width`` wide, a view of a ``padded``-wide one
    (as ``build_decode`` makes it)."""
    lens = rng.integers(1, width + 1, n)
    lens[rng.integers(n)] = width
    table = torch.full((n, padded), KVCache.SCRATCH, dtype=torch.long)
    for i, k in enumerate(lens):
        table[i, :k] = torch.from_numpy(rng.integers(1, 1000, k))
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(DEVICE)  # noqa: E731
    table = table.to(DEVICE)
    return ForwardBatch(ForwardMode.DECODE, t(rng.integers(0, 500, n)), t(lens - 1),
                        t(rng.integers(1, 1000, n)), t(np.arange(n)),
                        DecodeAttention(table[:, :width], t(lens)), (None,) * n, (1,) * n)


def _poisoned() -> DecodeBuffers:
    buffers = DecodeBuffers(BUCKETS, MAX_CONTEXT, DEVICE)
    for t in buffers._static:
        t.fill_(-777)
    return buffers


CASES = [(n, bucket, width) for bucket in BUCKETS for n in {0, 1, bucket // 2, bucket}
         if n <= bucket for width in (1, 17, MAX_CONTEXT)]


@pytest.mark.parametrize("n,bucket,width", CASES)
def test_one_launch_write_matches_torch_write(n, bucket, width):
    rng = np.random.default_rng(n * 100 + bucket * 10 + width)
    batch = None if n == 0 else _batch(rng, n, width, -(-width // 16) * 16)
    expected, got = _poisoned(), _poisoned()
    expected.write_by_torch(batch, n, bucket)
    src = None if batch is None else (batch.input_ids, batch.positions, batch.out_cache_loc,
                                      batch.attn.kv_lens, batch.attn.kv_indices)
    write_decode_inputs(got._static, src, bucket, KVCache.SCRATCH)
    for name, e, g in zip(("input_ids", "positions", "out_cache_loc", "kv_lens", "kv_indices"),
                          expected._static, got._static, strict=True):
        assert torch.equal(e, g), name
    assert (got.kv_indices[bucket:] == -777).all()
    if DEVICE == "cuda":  # the write the graphs use, rows past the bucket included
        fresh = _poisoned()
        fresh.write(batch, bucket)
        assert all(torch.equal(e, g)
                   for e, g in zip(expected._static, fresh._static, strict=True))


def test_write_refuses_a_batch_wider_than_the_buffers():
    buffers = _poisoned()
    batch = _batch(np.random.default_rng(0), 2, MAX_CONTEXT + 1, 48)
    src = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.attn.kv_lens,
           batch.attn.kv_indices)
    with pytest.raises(ValueError, match="wide"):
        write_decode_inputs(buffers._static, src, 2, KVCache.SCRATCH)
    with pytest.raises(ValueError, match="does not fit"):
        write_decode_inputs(buffers._static, src[:4] + (src[4][:, :8],), 1, KVCache.SCRATCH)


def test_a_batch_of_no_rows_writes_padding_like_an_idle_one():
    """Empty tensors (null pointers) as the batch: the kernel read row 0 of them (a segfault
    in the interpreter, an illegal address on a GPU)."""
    expected, got = _poisoned(), _poisoned()
    expected.write_by_torch(None, 0, 4)
    empty = torch.empty(0, dtype=torch.long, device=DEVICE)
    src = (empty,) * 4 + (torch.empty(0, 16, dtype=torch.long, device=DEVICE),)
    write_decode_inputs(got._static, src, 4, KVCache.SCRATCH)
    assert all(torch.equal(e, g) for e, g in zip(expected._static, got._static, strict=True))


def test_narrow_integer_sources_write_as_int64_and_floats_are_refused():
    """The replay casts nothing itself: int32 indices reach the one-launch write, which
    widens them (exact); a float source is refused naming its dtype."""
    batch = _batch(np.random.default_rng(5), 3, 17, 32)
    src = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.attn.kv_lens,
           batch.attn.kv_indices)
    want, got = _poisoned(), _poisoned()
    write_decode_inputs(want._static, src, 4, KVCache.SCRATCH)
    write_decode_inputs(got._static, tuple(t.int() for t in src), 4, KVCache.SCRATCH)
    assert all(torch.equal(a, b) for a, b in zip(want._static, got._static, strict=True))
    with pytest.raises(ValueError, match="integer index tensors, got torch.float32"):
        write_decode_inputs(got._static, src[:1] + (src[1].float(),) + src[2:], 4,
                            KVCache.SCRATCH)
