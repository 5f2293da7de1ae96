"""The model bench's one seam with the runtime: builds a model (random weights), its KV cache,
optionally a LoRA manager with random adapters, and a decode or prefill graph runner; exposes
the three timed paths and the checks. Every use of ``ModelRunner`` / ``GraphRunner`` by
``bench/`` is here, so a change of those APIs is adapted in this file alone."""

from __future__ import annotations

import torch

from bench.reference_checks import check_lora_rows
from bench.step_floor import matrix_bytes
from graphs import GraphRunner
from graphs.runner import BASE, LORA
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM

PREFILL_TOKENS = 2048  # prefill attention is dense over the packed batch: fill in chunks


class BenchRuntime:
    """``adapters == 0``: a runtime built without LoRA. Otherwise ``adapters`` random adapters,
    adapter i of rank ``ranks[i % len(ranks)]``, in as many GPU slots. ``step``: "decode"
    (buckets by batch size, ``context`` tokens cached per request) or "prefill" (buckets by
    token count, prompts of ``context`` tokens)."""

    def __init__(self, step: str, preset: str, layers: int, context: int, adapters: int,
                 ranks: tuple[int, ...], backend: str, dtype: torch.dtype,
                 batch_sizes: list[int], device: torch.device,
                 live_requests: int | None = None) -> None:
        self.config = config = PRESETS[preset](layers)
        self.device, self.context, self.step_kind = device, context, step
        self.model = LlamaForCausalLM.random(config, dtype, device)
        # Room for ``live_requests`` requests of each traffic (base, LoRA) held at once
        # (default: one batch of the largest size).
        room = live_requests or max(batch_sizes)
        self.kv = KVCache(config, 2 * room * (context + 8) + 8, dtype, device)
        self.names: list[str] = []
        self.lora = None
        self.adapters = {}  # the host adapters as built here: the merged reference's source
        if adapters > 0:
            self.lora = LoRAManager(self.model, LoRAConfig(adapters, max(ranks), backend=backend))
            self.names = [f"bench{i}" for i in range(adapters)]
            for i, n in enumerate(self.names):
                self.adapters[n] = random_adapter(config, n, ranks[i % len(ranks)], seed=i,
                                                  dtype=dtype)
                self.lora.load_adapter(n, self.adapters[n])
        self.runner = ModelRunner(self.model, self.kv, self.lora)
        if step == "decode":
            self.graphs = GraphRunner.decode(self.runner, sorted(set(batch_sizes)), context + 8)
        else:
            self.graphs = GraphRunner.prefill(self.runner, sorted({b * context for b in
                                                                   batch_sizes}),
                                              max(batch_sizes))
        self.graphs.capture()
        registered = getattr(self.runner, "graphs", None)
        if isinstance(registered, list) and self.graphs in registered:
            registered.remove(self.graphs)  # eager and graph paths are timed explicitly
        # The floor's bytes: the matrices a forward reads whole (not the embedding table, of
        # which it reads only its batch's rows; counting it put 61 published rows "below" it).
        self.weight_bytes = matrix_bytes(self.model)[0]

    @property
    def capture_stats(self) -> dict:
        s = self.graphs.stats
        return {"capture_seconds": s.total_capture_seconds, "graph_memory_bytes": s.memory_bytes,
                "graphs": len(self.graphs.graphs), "buckets": list(self.graphs.buffers.buckets)}

    def batch(self, batch_size: int, traffic: str, seed: int | None = None, shift: int = 0,
              prefilled: bool = True):
        """Requests of ``context`` prompt tokens, ``traffic == "lora"`` spreading them
        round-robin over the adapters. Prefill: their prompts. Decode: one new token each,
        the prompts already in the cache. Returns the batch and the requests. ``seed``: the
        same prompts in every runtime. ``shift``: request i gets adapter ``i + shift``.
        ``prefilled=False`` (decode): the prompts' slots are taken but not written (a batch
        whose logits nobody reads, only its layout)."""
        names = self.names if traffic == "lora" else [None]
        g = None if seed is None else torch.Generator().manual_seed(seed)
        reqs = [Request(torch.randint(0, self.config.vocab_size, (self.context,),
                                      generator=g).tolist(), names[(i + shift) % len(names)],
                        4)
                for i in range(batch_size)]
        if self.step_kind == "prefill":
            return build_extend(reqs, self.kv, self.device), reqs
        group = max(1, PREFILL_TOKENS // self.context)
        for i in range(0, batch_size, group):
            if prefilled:
                self.runner.forward_eager(build_extend(reqs[i : i + group], self.kv,
                                                       self.device))
        for r in reqs:
            if not prefilled:
                r.kv_slots = self.kv.alloc(len(r.prompt))
            r.output.append(1)
        return build_decode(reqs, self.kv, self.device), reqs

    def prime(self, batch_size: int) -> None:
        """Replays a batch of ``batch_size`` other requests (LoRA traffic, request i with
        adapter i + 1, where there are adapters), so the static buffers hold another batch's
        KV tables and LoRA layout of the shape about to be verified: a refresh skipped for a
        same-shape batch (stale metadata) then shows as replay != eager. The verified step is
        otherwise the first of its shape, and nothing stale can be read."""
        traffic = "lora" if self.names else "base"
        batch, reqs = self.batch(batch_size, traffic, shift=1, prefilled=False)
        try:
            self.step(batch)
        finally:
            self.release(reqs)

    def check_against_float64(self, got: torch.Tensor, reqs, what: str) -> dict:
        """The LoRA runtime's logits of ``reqs`` against each request run alone through the
        float64 model with its adapter (``bench.reference_checks.check_lora_rows``)."""
        return check_lora_rows(self.model, self.adapters, got, reqs, self.model_dtype, what)

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def release(self, reqs) -> None:
        self.kv.free([s for r in reqs for s in r.kv_slots])

    def eager(self, batch) -> torch.Tensor:
        """Prepare (LoRA plan) and an eager forward."""
        return self.runner.forward_eager(batch)

    def step(self, batch) -> torch.Tensor:
        """What a serving loop calls per step: plan, static-buffer refresh, replay."""
        return self.graphs.replay(batch)

    def idle_eager(self) -> torch.Tensor:
        """An idle step's eager forward, its batch built as a serving loop builds it."""
        return self.runner.forward_eager(self.runner.idle_batch())

    def idle_step(self) -> torch.Tensor:
        """An idle step's graph replay (the smallest bucket)."""
        return self.graphs.replay(self.runner.idle_batch())

    def leave_lora_batch(self) -> None:
        """Prepares a LoRA batch (one request of the first adapter) and leaves it, as a
        rank's last step with rows does before an idle step: an idle forward must not run
        it. Writes no KV slot (only the plan and its layouts)."""
        if self.lora is None or not self.names:
            return
        reqs = [Request([1] * 4, self.names[0], 1)]
        self.lora.prepare_lora_batch(build_extend(reqs, self.kv, self.device))
        self.release(reqs)

    @property
    def lora_active(self) -> bool:
        """Whether LoRA layers would launch their kernels (a batch is prepared)."""
        return self.lora is not None and self.lora.backend.batch_info is not None

    def kv_past_scratch(self) -> list[torch.Tensor]:
        """A copy of every KV slot but the scratch slot (padding rows write there only)."""
        return [t[KVCache.SCRATCH + 1 :].clone() for t in (*self.kv.k, *self.kv.v)]

    def replay_only(self, batch):
        """The captured graph that ``step(batch)`` replays, as a callable (the buffers keep
        what the last ``step`` wrote)."""
        self.step(batch)
        return self.graphs.graphs[(self.graphs.last_kind,
                                   self.graphs.buffers.bucket_for(batch))].replay

    @property
    def last_kind(self) -> str | None:
        return self.graphs.last_kind

    def expected_kind(self, batch) -> str:
        return LORA if self.lora is not None and batch.has_adapters else BASE

    def check_neutral_past(self, rows: int, requests: int) -> None:
        """Static LoRA metadata past the batch (padding rows, unused blocks) selects the
        neutral slot, so a replay of a larger bucket applies no adapter to them."""
        bufs, neutral = self.graphs.lora_buffers, self.lora.neutral_slot
        for layout, used in ((bufs.tokens, rows), (bufs.logits, requests)):
            full = layout.view(layout.max_rows)
            if not (full.token_slots[used:] == neutral).all():
                raise AssertionError("static LoRA buffers: padding rows past the batch do not "
                                     "select the neutral slot")
            live = full.block_ends > full.block_starts
            if not (full.block_slots[~live] == neutral).all():
                raise AssertionError("static LoRA buffers: unused blocks do not select the "
                                     "neutral slot")
            _check_live_blocks(full, used, neutral)


def _check_live_blocks(layout, used: int, neutral: int) -> None:
    """Every live block of an adapter covers rows of the batch that select that adapter: the
    kernels walk blocks, not rows, so a live block past the batch (or a permutation that
    points it at other rows) would add a term the rows' slots never named."""
    perm, token_slots = layout.permutation.tolist(), layout.token_slots.tolist()
    for slot, start, end in zip(layout.block_slots.tolist(), layout.block_starts.tolist(),
                                layout.block_ends.tolist(), strict=True):
        if slot == neutral or start >= end:
            continue
        rows = perm[start:end]
        if max(rows) >= used or any(token_slots[r] != slot for r in rows):
            raise AssertionError(f"static LoRA buffers: a block of slot {slot} covers rows "
                                 f"{rows[:8]} of a batch of {used} rows whose slots differ")
