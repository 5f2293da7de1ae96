"""The static-buffer contract for the model's own inputs: allocated once at the largest
bucket, refreshed in place before each replay, padding made harmless.

Padding rows read token 0 at position 0, write their K/V to the scratch slot, attend only to
scratch (decode) or to padding keys (prefill), so no request's cache or output is touched and
no NaN appears. (LoRA metadata has its own static buffers, owned by the LoRA backend.)
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable

import numpy as np
import torch

from kernels.decode_inputs import write_decode_inputs
from lora_runtime.checks import is_int
from lora_runtime.engine.forward_batch import (
    DecodeAttention,
    ExtendAttention,
    ForwardBatch,
    ForwardMode,
)
from lora_runtime.engine.kv_cache import KVCache

PAD_REQ = -1


def check_index_tensors(batch: ForwardBatch) -> None:
    """Refuses, naming the field, a batch whose ids, positions or cache indices are not of an
    integer dtype: the static buffers' copies truncated 3.6 to 3 where eager refused it."""
    ts = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.logits_rows,
          *vars(batch.attn).values())
    if {getattr(t, "dtype", None) for t in ts} <= _INDEX_DTYPES:  # ~1 us on a slow host
        return
    names = ("input_ids", "positions", "out_cache_loc", "logits_rows",
             *(f"attn.{k}" for k in vars(batch.attn)))
    name, t = next((n, t) for n, t in zip(names, ts, strict=True)
                   if getattr(t, "dtype", None) not in _INDEX_DTYPES)
    what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
    raise ValueError(f"batch.{name} is {what}: a replay takes integer index tensors (build "
                     "batches with build_decode / build_extend, or pass .long())")


_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _outside_inference_mode(init):
    """Allocates the buffers as normal tensors: made under ``torch.inference_mode()`` they
    were inference tensors, and every refresh by a replay outside it raised "Inplace update
    to inference tensor outside InferenceMode"."""

    @functools.wraps(init)
    def wrapped(*args, **kwargs) -> None:
        with torch.inference_mode(False):
            init(*args, **kwargs)

    return wrapped


def _put(dst: torch.Tensor, src: torch.Tensor | None, n: int, end: int, pad: int) -> None:
    if src is not None and n:
        dst[:n].copy_(src)
    if end > n:
        dst[n:end].fill_(pad)


def _checked_buckets(buckets, what: str) -> list[int]:
    """The buckets, sorted, once each, as Python ints. Read once: a generator was used up by
    the check (IndexError); one int raised "not iterable", a tensor or array "ambiguous"."""
    if isinstance(buckets, (torch.Tensor, np.ndarray)):
        buckets = buckets.tolist()
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        one = f" (for one bucket: [{buckets}])" if is_int(buckets) else ""
        raise ValueError(f"graph buckets must be a non-empty list of {what} >= 1, got "
                         f"{buckets!r}{one}")
    buckets = list(buckets)
    if not buckets or not all(is_int(b) and b >= 1 for b in buckets):
        raise ValueError(f"graph buckets must be a non-empty list of {what} >= 1, got "
                         f"{buckets!r}")
    return sorted({int(b) for b in buckets})  # numpy ints reached results and step records


def _check_size(name: str, value, least: int) -> int:
    """``value`` as a Python int (a numpy one is not JSON-serializable)."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


class DecodeBuffers:
    """Decode: one token per request; buckets are batch sizes."""

    mode = ForwardMode.DECODE

    @_outside_inference_mode
    def __init__(self, buckets: list[int], max_context: int, device) -> None:
        self.buckets = _checked_buckets(buckets, "batch sizes")
        max_context = _check_size("max_context", max_context, 1)
        bs = self.buckets[-1]
        self.max_context = max_context
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc = z(bs), z(bs), z(bs)
        self.logits_rows = torch.arange(bs, device=device)
        self.kv_indices, self.kv_lens = z(bs, max_context), torch.ones(bs, dtype=torch.long,
                                                                        device=device)
        self._static = (self.input_ids, self.positions, self.out_cache_loc, self.kv_lens,
                        self.kv_indices)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        if batch.mode is ForwardMode.IDLE:
            return self.buckets[0]
        if batch.mode is not ForwardMode.DECODE:
            return None
        if batch.attn.kv_indices.shape[1] > self.max_context:
            return None
        i = bisect.bisect_left(self.buckets, batch.batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def misfit(self, batch: ForwardBatch) -> str:
        """Why ``bucket_for(batch)`` is None: the limit the batch exceeds."""
        if batch.mode is not ForwardMode.DECODE:
            return f"decode graphs replay decode batches, not {batch.mode.value} ones"
        width = batch.attn.kv_indices.shape[1]
        if width > self.max_context:
            return (f"its KV context of {width} tokens exceeds max_context "
                    f"{self.max_context}")
        return f"its {batch.batch_size} requests exceed the largest bucket {self.buckets[-1]}"

    def rows(self, bucket: int) -> int:
        return bucket

    def requests(self, bucket: int) -> int:
        return bucket

    def view(self, bucket: int) -> ForwardBatch:
        return ForwardBatch(
            ForwardMode.DECODE, self.input_ids[:bucket], self.positions[:bucket],
            self.out_cache_loc[:bucket], self.logits_rows[:bucket],
            DecodeAttention(self.kv_indices[:bucket], self.kv_lens[:bucket]),
            (None,) * bucket, (1,) * bucket,
        )

    def write(self, batch: ForwardBatch | None, bucket: int) -> None:
        """Copies ``batch`` into the first rows (None: idle) and neutralises the rest: on a
        GPU in one launch (``kernels.decode_inputs``), else by ``write_by_torch``."""
        n = 0 if batch is None or batch.mode is ForwardMode.IDLE else batch.batch_size
        b = None if n == 0 else batch
        if self.input_ids.device.type == "cuda":
            src = None if b is None else (b.input_ids, b.positions, b.out_cache_loc,
                                          b.attn.kv_lens, b.attn.kv_indices)
            write_decode_inputs(self._static, src, bucket, KVCache.SCRATCH)
        else:
            self.write_by_torch(b, n, bucket)

    def write_by_torch(self, b: ForwardBatch | None, n: int, bucket: int) -> None:
        """``write`` of ``n`` rows of ``b`` (None: idle) by torch copies and fills."""
        _put(self.input_ids, b and b.input_ids, n, bucket, 0)
        _put(self.positions, b and b.positions, n, bucket, 0)
        _put(self.out_cache_loc, b and b.out_cache_loc, n, bucket, KVCache.SCRATCH)
        _put(self.kv_lens, b and b.attn.kv_lens, n, bucket, 1)
        if n:
            c = b.attn.kv_indices.shape[1]
            self.kv_indices[:n, :c].copy_(b.attn.kv_indices)
            self.kv_indices[:n, c:].fill_(KVCache.SCRATCH)
        self.kv_indices[n:bucket].fill_(KVCache.SCRATCH)


class PrefillBuffers:
    """Prefill (extend): buckets are token counts; at most ``max_requests`` requests and
    ``max_prefix`` cached tokens in total per batch."""

    mode = ForwardMode.EXTEND

    @_outside_inference_mode
    def __init__(self, buckets: list[int], max_requests: int, max_prefix: int, device) -> None:
        self.buckets = _checked_buckets(buckets, "token counts")
        max_requests = _check_size("max_requests", max_requests, 1)
        max_prefix = _check_size("max_prefix", max_prefix, 0)
        t = self.buckets[-1]
        self.max_requests, self.max_prefix = max_requests, max_prefix
        c = t + max_prefix
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc = z(t), z(t), z(t)
        self.token_req = torch.full((t,), PAD_REQ, dtype=torch.long, device=device)
        self.logits_rows = z(max_requests)
        self.kv_indices, self.kv_pos = z(c), z(c)
        self.kv_req = torch.full((c,), PAD_REQ, dtype=torch.long, device=device)
        # One request more than a batch holds: the padding tokens form their own request,
        # attending to scratch keys, so the per-request kernels leave no row unwritten.
        self.q_starts = torch.zeros(max_requests + 2, dtype=torch.int32, device=device)
        self.kv_starts = torch.zeros(max_requests + 2, dtype=torch.int32, device=device)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        if batch.mode is not ForwardMode.EXTEND or batch.batch_size > self.max_requests:
            return None
        if batch.attn.kv_indices.shape[0] - batch.num_tokens > self.max_prefix:
            return None
        i = bisect.bisect_left(self.buckets, batch.num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def misfit(self, batch: ForwardBatch) -> str:
        """Why ``bucket_for(batch)`` is None: the limit the batch exceeds."""
        if batch.mode is not ForwardMode.EXTEND:
            return f"prefill graphs replay extend batches, not {batch.mode.value} ones"
        if batch.batch_size > self.max_requests:
            return f"its {batch.batch_size} requests exceed max_requests {self.max_requests}"
        prefix = batch.attn.kv_indices.shape[0] - batch.num_tokens
        if prefix > self.max_prefix:
            return f"its {prefix} cached tokens exceed max_prefix {self.max_prefix}"
        return f"its {batch.num_tokens} tokens exceed the largest bucket {self.buckets[-1]}"

    def rows(self, bucket: int) -> int:
        return bucket

    def requests(self, bucket: int) -> int:
        return self.max_requests

    def view(self, bucket: int) -> ForwardBatch:
        c = bucket + self.max_prefix
        r = self.max_requests
        return ForwardBatch(
            ForwardMode.EXTEND, self.input_ids[:bucket], self.positions[:bucket],
            self.out_cache_loc[:bucket], self.logits_rows,
            ExtendAttention(self.token_req[:bucket], self.kv_indices[:c], self.kv_req[:c],
                            self.kv_pos[:c], self.q_starts, self.kv_starts),
            (None,) * r, (bucket,) + (0,) * (r - 1),
        )

    def write(self, batch: ForwardBatch | None, bucket: int) -> None:
        t = 0 if batch is None else batch.num_tokens
        n = 0 if batch is None else batch.batch_size
        c = 0 if batch is None else batch.attn.kv_indices.shape[0]
        b, a = batch, None if batch is None else batch.attn
        _put(self.input_ids, b and b.input_ids, t, bucket, 0)
        _put(self.positions, b and b.positions, t, bucket, 0)
        _put(self.out_cache_loc, b and b.out_cache_loc, t, bucket, KVCache.SCRATCH)
        _put(self.token_req, a and a.token_req, t, bucket, PAD_REQ)
        _put(self.logits_rows, b and b.logits_rows, n, self.max_requests, 0)
        end = bucket + self.max_prefix
        _put(self.kv_indices, a and a.kv_indices, c, end, KVCache.SCRATCH)
        _put(self.kv_req, a and a.kv_req, c, end, PAD_REQ)
        _put(self.kv_pos, a and a.kv_pos, c, end, 0)
        if a is None:
            self.q_starts[:1].zero_()
            self.kv_starts[:1].zero_()
        else:
            self.q_starts[: n + 1].copy_(a.q_starts)
            self.kv_starts[: n + 1].copy_(a.kv_starts)
        self.q_starts[n + 1 :].fill_(bucket)
        self.kv_starts[n + 1 :].fill_(c + bucket - t)
