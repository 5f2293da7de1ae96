"""A generation request and the batches built from requests (host lists -> device tensors)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np
import torch

from lora_runtime.checks import is_int
from lora_runtime.engine.forward_batch import (
    DecodeAttention,
    ExtendAttention,
    ForwardBatch,
    ForwardMode,
)
from lora_runtime.engine.host_copy import to_device
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.metrics import RequestMetrics
from lora_runtime.engine.slots import SlotList


def int_ids(label: str, ids) -> list[int]:
    """``ids`` as a list of Python ints; ValueError naming ``label`` where one is not an
    integer (bool is not). Plain ints take the fast path: one set of the ids' types, where an
    ``isinstance`` test per id cost ~0.5 us a token (8-17 ms for 64 prompts of 256 tokens,
    on the host, inside the throughput bench's timed pass)."""
    if set(map(type, ids)) <= {int}:
        return list(ids)
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise ValueError(f"{label} token ids must be integers, got {bad[:5]!r}")
    return [int(t) for t in ids]


def id_sequence(label: str, ids, ordered: bool = True) -> list:
    """``ids`` as a list, where it is a sequence of ids; ValueError naming ``label`` where it
    is not one (an int, None, text or bytes: ``list("12")`` would read characters, a
    bytearray its bytes; a tokenizer's output: its ``input_ids`` are the ids). A 1-D tensor or
    array (a tokenizer's ``input_ids[0]``) gives its values (``list()`` of a tensor gave 0-d
    tensors, refused as 'not integers'); one of another rank (a batch) is refused. With
    ``ordered`` a set or a mapping is refused too: its order is not the ids' (a prompt
    ``{5, 1, 3}`` was served as [1, 3, 5])."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1:
            # Unordered ids are stop ids: a prompt's batch fix would name the wrong one.
            what = "one prompt's token ids" if ordered else "token ids"
            fix = ("pass a list of ids ([id] for one)" if ids.ndim == 0 else
                   "for a tokenizer's batch of one pass ids[0]; for several prompts, "
                   "Engine.add_requests" if ordered else "pass them flat: ids.flatten()")
            raise ValueError(f"{label} must be {what} (1-D), got a {ids.ndim}-D "
                             f"{type(ids).__name__} of shape {tuple(ids.shape)}: {fix}")
        return ids.tolist()
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        # A bytearray or memoryview iterates as ints: its bytes were served as token ids.
        raise ValueError(f"{label} must be a sequence of token ids, got {type(ids).__name__} "
                         f"{ids!r:.60}: tokenize the text with the model's tokenizer and pass "
                         f"its ids, e.g. tokenizer(text)['input_ids']")
    if isinstance(ids, Mapping) and "input_ids" in ids:
        raise ValueError(f"{label} must be a sequence of token ids, got a tokenizer's output "
                         f"({type(ids).__name__} of {list(ids)}): pass its ids, e.g. "
                         f"tokenizer(text)['input_ids']")
    if not hasattr(ids, "__iter__"):
        raise ValueError(f"{label} must be a sequence of token ids, got {ids!r}")
    if ordered and isinstance(ids, (AbstractSet, Mapping)):
        raise ValueError(f"{label} must be an ordered sequence of token ids, got a "
                         f"{type(ids).__name__}, whose order is not the ids': pass a list")
    return list(ids)


def check_max_new_tokens(value, call: str = "") -> None:
    """ValueError (prefixed with ``call``) unless ``value`` is an integer >= 1: a float budget
    (4.5) would reserve a fractional KV budget and sample past it."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{call}max_new_tokens must be an integer >= 1, got {value!r}")


@dataclass(eq=False)
class Request:
    prompt: list[int]
    adapter: str | None = None
    max_new_tokens: int = 16
    stop_ids: tuple[int, ...] = ()
    """Generation ends after any of these tokens (it is kept in ``output``)."""
    output: list[int] = field(default_factory=list)
    kv_slots: SlotList = field(default_factory=SlotList)
    """Assigning a list converts it (``r.kv_slots = kv.alloc(n)``)."""
    id: int = -1
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finish_reason: str | None = None
    """Why it finished: ``"stop"`` (a stop id), ``"length"`` (``max_new_tokens``) or
    ``"abort"`` (``Engine.abort``); None while it runs."""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a request needs a non-empty prompt")
        check_max_new_tokens(self.max_new_tokens)
        self.max_new_tokens = int(self.max_new_tokens)
        self.prompt = int_ids("prompt", self.prompt)
        self.stop_ids = tuple(int_ids("stop_ids", self.stop_ids))

    def __setattr__(self, name, value) -> None:
        if name == "kv_slots" and not isinstance(value, SlotList):
            value = SlotList(value)
        super().__setattr__(name, value)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        if self.finish_reason == "abort":
            return True
        if self.output and self.output[-1] in self.stop_ids:
            return True
        return len(self.output) >= self.max_new_tokens

    @property
    def uncached(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt (prefill) or the last one."""
        return self.num_tokens - len(self.kv_slots)

    @property
    def prefilling(self) -> bool:
        return len(self.kv_slots) < len(self.prompt)

    @property
    def kv_budget(self) -> int:
        """KV slots this request can ever hold: its prompt and every token it may sample but
        the last (never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1


def build_extend(reqs: Sequence[Request], kv: KVCache, device,
                 limits: Sequence[int] | None = None) -> ForwardBatch:
    """The tokens of each request not yet in the cache (a prefill, or a continuation); with
    ``limits``, at most ``limits[i]`` of them for request ``i`` (a chunk of a long prompt).
    Raises, changing no request and no KV slot, where one has nothing to extend, a limit is not
    an integer >= 1, or the cache cannot hold them all."""
    _check_limits(limits, len(reqs))
    ids, loc, kv_idx, prefixes, lens = [], [], [], [], []
    for i, r in enumerate(reqs):
        prefix = len(r.kv_slots)
        new = (r.prompt[prefix:] + r.output) if prefix < len(r.prompt) \
            else r.output[prefix - len(r.prompt):]
        if limits is not None:
            new = new[: limits[i]]
        if not new:
            raise ValueError(f"request {i} has nothing to extend")
        ids += new
        prefixes.append(prefix)
        lens.append(len(new))
    loc = kv.alloc(len(ids))  # one allocation for all: refused whole, not part-way
    lo = 0
    for r, n in zip(reqs, lens, strict=True):
        r.kv_slots.extend(loc[lo : lo + n])
        lo += n
        kv_idx.append(r.kv_slots.array)  # concatenated (copied) below, before any change
    n = np.asarray(lens, dtype=np.int64)
    kv_lens = np.asarray([len(r.kv_slots) for r in reqs], dtype=np.int64)
    q_starts = np.concatenate(([0], np.cumsum(n)))
    kv_starts = np.concatenate(([0], np.cumsum(kv_lens)))
    requests = np.arange(len(reqs), dtype=np.int64)
    # Row j of request i sits at position prefix_i + j (its KV key j at position j).
    pos = np.arange(q_starts[-1]) - np.repeat(q_starts[:-1] - np.asarray(prefixes, np.int64), n)
    kv_pos = np.arange(kv_starts[-1]) - np.repeat(kv_starts[:-1], kv_lens)
    kv_table = np.concatenate(kv_idx) if kv_idx else np.zeros(0, dtype=np.int64)
    (t_ids, t_pos, t_loc, t_ends, t_req, t_kv, t_kv_req, t_kv_pos, t_q, t_kvs) = to_device(
        [np.asarray(ids, dtype=np.int64), pos, np.asarray(loc, dtype=np.int64), q_starts[1:] - 1,
         np.repeat(requests, n), kv_table, np.repeat(requests, kv_lens), kv_pos,
         q_starts.astype(np.int32), kv_starts.astype(np.int32)], device)
    return ForwardBatch(
        ForwardMode.EXTEND, t_ids, t_pos, t_loc, t_ends,
        ExtendAttention(t_req, t_kv, t_kv_req, t_kv_pos, t_q, t_kvs),
        tuple(r.adapter for r in reqs), tuple(lens),
    )


def _check_limits(limits: Sequence[int] | None, n: int) -> None:
    """``build_extend``'s chunk sizes: one integer >= 1 a request (a negative one cut the
    prompt's last tokens off the chunk, silently; a short list raised IndexError)."""
    if limits is None:
        return
    if len(limits) != n or not all(is_int(k) and k >= 1 for k in limits):
        raise ValueError(f"limits must give each of the {n} requests a chunk size (an integer "
                         f">= 1), got {list(limits)!r:.80}")


def build_decode(reqs: Sequence[Request], kv: KVCache, device,
                 pending: torch.Tensor | None = None,
                 pending_rows: Sequence[int] | None = None) -> ForwardBatch:
    """One token per request: the last sampled one, not yet in the cache. ``pending``: the
    step runs ahead of the one that samples its tokens (``Engine(overlap=True)``), whose
    tokens are still on the device: request i's last token is not in its output yet but is
    ``pending[pending_rows[i]]`` (by default ``pending[i]``); a row of -1 marks a request
    whose last token is in its output (it did not sample in that step)."""
    n = len(reqs)
    if pending is None:
        rows = [-1] * n
    elif pending_rows is None:
        if tuple(pending.shape) != (n,):
            raise ValueError(f"pending has shape {tuple(pending.shape)}, expected ({n},)")
        rows = list(range(n))
    else:
        rows = list(pending_rows)
        if len(rows) != n or not all(-1 <= i < pending.shape[0] for i in rows):
            raise ValueError(f"pending_rows must give each of the {n} requests a row of "
                             f"pending ({pending.shape[0]} rows) or -1, got {rows}")
    for i, (r, row) in enumerate(zip(reqs, rows, strict=True)):
        if len(r.kv_slots) != r.num_tokens - (row < 0):
            raise ValueError(f"request {i} is not ready to decode: {r.num_tokens} tokens"
                             f"{' and one pending' if row >= 0 else ''}, {len(r.kv_slots)} "
                             "cached")
    slots = kv.alloc(n)
    for r, s in zip(reqs, slots, strict=True):
        r.kv_slots.append(s)
    lens = np.asarray([len(r.kv_slots) for r in reqs], dtype=np.int64)
    # The rows are 16-aligned in memory, the table as wide as the longest context: its row
    # stride is a kernel argument, and Triton compiles a variant per divisibility class of it
    # (a compile mid-serving stalls the step by ~1 s), while graphs pick buckets by its width.
    width = int(lens.max()) if n else 1
    table = np.full((n, -(-width // 16) * 16), KVCache.SCRATCH, dtype=np.int64)
    for row, r, k in zip(table, reqs, lens, strict=True):
        row[:k] = r.kv_slots.array
    fields = [lens - 1, np.asarray(slots, dtype=np.int64), np.arange(n, dtype=np.int64), table,
              lens]
    every_row_pending = pending is not None and rows == list(range(pending.shape[0]))
    if not every_row_pending:
        fields.append(np.asarray([0 if row >= 0 else r.last_token
                                  for r, row in zip(reqs, rows, strict=True)], dtype=np.int64))
        if pending is not None:
            fields.append(np.asarray(rows, dtype=np.int64))
    pos, loc, batch_rows, t_table, t_lens, *last = to_device(fields, device)
    if every_row_pending:
        ids = pending.to(device=pos.device, dtype=torch.int64)
    elif pending is None:
        ids = last[0]
    else:  # some tokens on the host, the others still on the device
        known, from_rows = last
        taken = pending.to(device=pos.device, dtype=torch.int64)[from_rows.clamp(min=0)]
        ids = torch.where(from_rows >= 0, taken, known)
    return ForwardBatch(
        ForwardMode.DECODE, ids, pos, loc, batch_rows, DecodeAttention(t_table[:, :width], t_lens),
        tuple(r.adapter for r in reqs), (1,) * n,
    )


def release(reqs: Sequence[Request], kv: KVCache) -> None:
    for r in reqs:
        kv.free(r.kv_slots)
        r.kv_slots = []
