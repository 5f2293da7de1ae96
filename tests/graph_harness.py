"""One place for everything the block-table, slot-reuse and prefix tests touch of the graph
runners and of the LoRA backend's static metadata (test_graph_blocks.py, test_slot_reuse.py,
test_prefill_prefix_graphs.py). When the GraphRunner / LoRA-hook API moves, adapt this file.

``Harness.step(batch)`` runs a batch eagerly, then replays it in its graph (or checks that no
bucket takes it), and checks: replay logits equal eager ones (every row, none dropped), the
right graph kind, and the static LoRA metadata the graph read equals the eager layout for the
batch's rows and is neutral past them (rows and blocks), both in the bucket's own view and in
the full buffer.
"""

from __future__ import annotations

import functools

import torch
from runtime_helpers import ALL_TARGETS, make_runtime, merged_model, reference_logits

from graphs import GraphRunner
from graphs.runner import BASE, LORA
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny
from lora_runtime.model.modules import SLICES

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

# The shared graph world (capture is the costly part on CPU: one per backend per session).
SLOTS = 3
DECODE_BUCKETS, MAX_CONTEXT = [1, 24, 56], 24  # block tables of 5, 6 and 8 blocks
PREFILL_BUCKETS, MAX_REQUESTS, MAX_PREFIX = [16, 80, 208], 8, 48  # 5, 6 and 8 blocks


@functools.cache
def shared(backend: str, device) -> Harness:
    """One 1-layer fp32 world per backend, shared by the test files that use this module;
    call ``reset()`` before use."""
    return Harness(backend, device, decode_buckets=DECODE_BUCKETS, max_context=MAX_CONTEXT,
                   prefill_buckets=PREFILL_BUCKETS, max_requests=MAX_REQUESTS,
                   max_prefix=MAX_PREFIX, slots=SLOTS)


class Harness:
    def __init__(self, backend: str, device, *, decode_buckets=(), max_context=16,
                 prefill_buckets=(), max_requests=4, max_prefix=0, slots=3, max_rank=8,
                 targets=ALL_TARGETS, layers=1, kv_tokens=4096, dtype=torch.float32) -> None:
        self.device, self.dtype, self.backend = device, dtype, backend
        self.config = tiny(layers)
        self.runner = make_runtime(self.config, dtype=dtype, device=device, backend=backend,
                                   slots=slots, max_rank=max_rank, targets=targets,
                                   kv_tokens=kv_tokens)
        self.lora = self.runner.lora
        self.decode = (GraphRunner.decode(self.runner, list(decode_buckets), max_context)
                       .capture() if decode_buckets else None)
        self.prefill = (GraphRunner.prefill(self.runner, list(prefill_buckets), max_requests,
                                            max_prefix).capture() if prefill_buckets else None)
        self._merged: dict[int, tuple[object, object]] = {}
        self.replays = self.eager_only = self.oracle_checks = 0

    def reset(self) -> Harness:
        """No adapter loaded, nothing prepared, an empty KV cache."""
        self.lora.reset_lora_batch()
        for name in list(self.lora.adapters):
            self.lora.unload_adapter(name)
        self.runner.kv.reset()
        self._merged = {}
        return self

    # -- adapters ---------------------------------------------------------------------------
    def adapter(self, name: str, rank: int, targets, *, seed: int, alpha: float | None = None,
                load: bool = True, pinned: bool = False):
        ad = random_adapter(self.config, name, rank, list(targets), seed=seed, b_std=0.3,
                            alpha=alpha)
        if load:
            self.lora.load_adapter(name, ad, pinned=pinned)
        return ad

    # -- graphs -----------------------------------------------------------------------------
    def graph_for(self, batch: ForwardBatch) -> GraphRunner | None:
        return self.decode if batch.mode is ForwardMode.DECODE else self.prefill

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket a replay of ``batch`` would use (None: it must run eagerly)."""
        g = self.graph_for(batch)
        if g is None or not g.can_run(batch):
            return None
        return g.buffers.bucket_for(batch)

    def step(self, batch: ForwardBatch, *, expect_bucket: int | None | str = "any"
             ) -> torch.Tensor:
        """Eager forward, then the replay of the same batch; returns the eager logits.
        ``expect_bucket``: the bucket the replay must use (None: no graph may take it)."""
        eager = self.runner.forward_eager(batch).clone()
        assert eager.shape[0] == batch.batch_size
        eager_layouts = self._eager_layouts()
        g = self.graph_for(batch)
        bucket = self.bucket(batch)
        if expect_bucket != "any":
            assert bucket == expect_bucket, (
                f"{batch.mode.value} batch of {batch.batch_size} requests, {batch.num_tokens} "
                f"tokens: bucket {bucket}, expected {expect_bucket}")
        if bucket is None:
            if g is not None:
                assert not g.can_run(batch)
                try:
                    g.replay(batch)
                except ValueError:
                    pass
                else:
                    raise AssertionError("replay of a batch no bucket holds must refuse")
            self.eager_only += 1
            return eager
        got = g.replay(batch)
        tol = TOL[self.dtype]
        assert got.shape == eager.shape, f"replay returned {tuple(got.shape)} logits rows"
        torch.testing.assert_close(
            got, eager, rtol=tol, atol=tol,
            msg=lambda m: f"replay (bucket {bucket}, {g.last_kind}) differs from eager "
            f"({batch.mode.value}, {batch.batch_size} requests, {batch.num_tokens} tokens, "
            f"adapters {batch.adapter_names}): {m}")
        want = LORA if batch.has_adapters else BASE
        assert g.last_kind == want, f"replayed the {g.last_kind} graph, expected {want}"
        if want == LORA:
            self._check_static_layouts(g, eager_layouts, batch.num_tokens, batch.batch_size)
        self.replays += 1
        return eager

    def _eager_layouts(self):
        """Host copies of the exact-size layouts the eager forward used (None: no LoRA)."""
        b = self.lora.backend
        if b.batch_info is None:
            return None
        return tuple(_host(lay) for lay in (b.batch_info.rows, b.logits_info))

    def _check_static_layouts(self, g: GraphRunner, eager, rows: int, requests: int) -> None:
        b = self.lora.backend
        assert eager is not None, "a batch with adapters must prepare LoRA eagerly"
        seen = (b.batch_info.rows, b.logits_info)  # the views the replay's graph was given
        for what, static, view, want, used in zip(
                ("tokens", "logits"), (g.lora_buffers.tokens, g.lora_buffers.logits), seen,
                eager, (rows, requests), strict=True):
            full = _host(static.view(static.max_rows))
            got = _host(view)
            nb = len(got["block_slots"])
            live = len(want["block_slots"])
            assert live <= nb, (f"{what}: the batch has {live} blocks but the bucket's block "
                                f"table holds {nb}")
            for k in ("block_slots", "block_starts", "block_ends"):
                assert got[k] == full[k][:nb], f"{what}: the bucket's view of {k} is misplaced"
                assert got[k][:live] == want[k], f"{what}: {k} differ from the eager layout"
            for k in ("token_slots", "permutation"):
                assert got[k] == full[k][: len(got[k])], f"{what}: {k} view misplaced"
                assert full[k][:used] == want[k], f"{what}: {k} differ from the eager layout"
            neutral = self.lora.neutral_slot
            assert all(s == neutral for s in full["token_slots"][used:]), \
                f"{what}: padding rows must be the neutral slot"
            for k in range(live, len(full["block_slots"])):
                assert full["block_starts"][k] == full["block_ends"][k], \
                    f"{what}: block {k} past the batch is not empty"
                assert full["block_slots"][k] == neutral, \
                    f"{what}: block {k} past the batch is not neutral"

    # -- slots ------------------------------------------------------------------------------
    def slot_tables(self, slot: int) -> dict[tuple[int | None, str], tuple[int, float]]:
        """(rank, scaling) of every (layer, PEFT target) in ``slot``'s device tables."""
        out = {}
        for (layer, module), w in self.lora.weights.items():
            for s, target in enumerate(SLICES[module]):
                out[(layer, target)] = (int(w.ranks[slot, s]), float(w.scalings[slot, s]))
        return out

    def assert_slot_holds(self, slot: int, adapter) -> None:
        """The slot's ranks and scalings are ``adapter``'s; rank 0 where it has no module."""
        assert self.lora.pool.owner[slot] == adapter.name
        for key, (rank, scaling) in self.slot_tables(slot).items():
            m = adapter.modules.get(key)
            want = (0, 0.0) if m is None else (m.rank, m.scaling)
            assert rank == want[0], f"slot {slot} {key}: rank {rank}, {adapter.name} has {want}"
            assert abs(scaling - want[1]) <= 1e-6 * max(1.0, abs(want[1])), \
                f"slot {slot} {key}: scaling {scaling}, {adapter.name} has {want[1]}"

    # -- the dense oracle -------------------------------------------------------------------
    def oracle(self, tokens: list[int], adapter, logits: torch.Tensor) -> None:
        """``logits`` equal a from-scratch forward of ``tokens`` through the base model merged
        with ``adapter`` (a LoRAAdapter object or None)."""
        ref = self.reference(tokens, adapter)
        tol = TOL[self.dtype]
        name = None if adapter is None else adapter.name
        torch.testing.assert_close(logits, ref, rtol=tol, atol=tol,
                                   msg=lambda m: f"differs from the merged model of {name}: {m}")
        self.oracle_checks += 1

    def reference(self, tokens: list[int], adapter) -> torch.Tensor:
        key = id(adapter)
        if key not in self._merged:
            self._merged[key] = (adapter, merged_model(self.runner.model, adapter))
        return reference_logits(self._merged[key][1], list(tokens), self.dtype, self.device)


def prefill_then_decode(h: Harness, ads, device, prefill_bucket: int, decode_bucket: int,
                        decodes: int = 2, after_prefill=None) -> None:
    """A request per adapter of ``ads`` (None: the base model), prompts of 1, 4, 7, ...
    tokens: one prefill replay, then ``decodes`` decode replays, every row checked against
    the merged-model oracle; ``after_prefill()`` runs between the prefill and the decodes."""
    from lora_runtime.engine.requests import Request, build_decode, build_extend, release

    reqs = [Request(list(range(1, 2 + 3 * i)), None if ad is None else ad.name, 8)
            for i, ad in enumerate(ads)]
    logits = h.step(build_extend(reqs, h.runner.kv, device), expect_bucket=prefill_bucket)
    if after_prefill is not None:
        after_prefill()
    for _ in range(decodes):
        for r, ad, row in zip(reqs, ads, logits, strict=True):
            h.oracle(r.tokens, ad, row)
            r.output.append(int(row.argmax()))
        logits = h.step(build_decode(reqs, h.runner.kv, device), expect_bucket=decode_bucket)
    release(reqs, h.runner.kv)


def _host(layout) -> dict[str, list[int]]:
    return {k: getattr(layout, k).tolist() for k in
            ("token_slots", "permutation", "block_slots", "block_starts", "block_ends")}
