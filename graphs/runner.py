"""``GraphRunner``: captures one graph per bucket (largest first), twice when LoRA is on (a
graph with LoRA launches and one without), and replays the smallest bucket that fits. Under
DP attention it captures a third variant, ``peers``: LoRA on the MLP's gathered rows only,
for a rank whose own rows have no adapter while its peers' do (an idle rank, or one serving
base-only requests): its attention, embedding and lm_head then launch no LoRA kernel. The
variants differ only in LoRA launches, never in collectives, so ranks may replay different
ones in the same step.

Replay contract (contracts 4-6): every tensor a replay reads is a static buffer refreshed in
place just before it (the model inputs here, LoRA metadata through the backend's graph
hooks); padding rows and idle replays leave LoRA neutral; a batch without adapters replays
the graph without LoRA, and so does an idle one (nothing of its own to adapt), except on a
data-parallel rank, whose MLP serves its peers' rows: the step agreement picks the variant
there (``variant_for``), and the rank's own rows stay neutral.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from graphs.replayable import Replayable, capture, new_pool
from graphs.static_batch import DecodeBuffers, PrefillBuffers, check_index_tensors
from lora_runtime.checks import is_int
from lora_runtime.engine.forward_batch import (
    ForwardBatch,
    ForwardMode,
    GatheredRows,
    check_gathered,
)
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.lora.backends import LoRAGraphBuffers
from lora_runtime.model.gemm_library import rows_library
from lora_runtime.nvtx import phase

LORA, PEERS, BASE = "lora", "peers", "base"


@dataclass
class GraphStats:
    capture_seconds: dict[str, float] = field(default_factory=dict)
    memory_bytes: int = 0
    """Device memory the graphs hold (their pool), measured around the captures."""

    @property
    def total_capture_seconds(self) -> float:
        return sum(self.capture_seconds.values())


class GraphRunner:
    def __init__(self, runner: ModelRunner, buffers: DecodeBuffers | PrefillBuffers) -> None:
        self.runner, self.buffers = runner, buffers
        self.device = runner.device
        self.lora = runner.lora
        self.graphs: dict[tuple[str, int], Replayable] = {}
        self.lora_buffers: LoRAGraphBuffers | None = None
        self.stats = GraphStats()
        self.last_kind: str | None = None
        self.last_bucket: int | None = None

    @staticmethod
    def decode(runner: ModelRunner, buckets: list[int], max_context: int) -> GraphRunner:
        return GraphRunner(runner, DecodeBuffers(buckets, max_context, _device_of(runner)))

    @staticmethod
    def prefill(runner: ModelRunner, buckets: list[int], max_requests: int,
                max_prefix: int = 0) -> GraphRunner:
        return GraphRunner(runner, PrefillBuffers(buckets, max_requests, max_prefix,
                                                  _device_of(runner)))

    @property
    def dp(self):
        """The runner's DP group, read from the model (a graph runner built before
        ``shard_mlp`` captured the sharded MLP as unsharded and failed inside it)."""
        return self.runner.dp

    # -- capture ------------------------------------------------------------------------------
    def capture(self) -> GraphRunner:
        """Captures every bucket and variant; one that fails leaves no graph (``can_run`` is
        False, so batches run eagerly), no stats of them and no LoRA batch prepared."""
        try:
            return self._capture_all()
        except BaseException:
            self.graphs.clear()
            self.stats = GraphStats()  # the failed attempt's times described no graph
            if self.lora is not None:
                self.lora.reset_lora_batch()
            raise

    def _capture_all(self) -> GraphRunner:
        buf = self.buffers
        kinds = [BASE]
        if self.lora is not None:
            top = buf.buckets[-1]
            with torch.inference_mode(False):  # refreshed in place by replays in any mode
                self.lora_buffers = self.lora.init_graph_buffers(buf.mode, buf.rows(top),
                                                                 buf.requests(top))
            peers = [PEERS] if self.lora_buffers.gathered is not None else []
            kinds = [LORA, *peers, BASE]
        pool = new_pool(self.device)
        before = _pool_bytes(self.device)
        for bucket in reversed(buf.buckets):
            for kind in kinds:
                self._set_lora(kind, None, bucket, capture=True)
                buf.write(None, bucket)
                batch = buf.view(bucket)
                if self.dp is not None:
                    rows = buf.rows(bucket)
                    batch = dataclasses.replace(batch, gathered=GatheredRows(
                        buf.mode, rows, ((),) * self.dp.size, ((),) * self.dp.size))
                t0 = time.perf_counter()
                with rows_library(buf.rows(bucket), self.device):
                    self.graphs[(kind, bucket)] = capture(self._forward_of(batch), self.device,
                                                          pool)
                self.stats.capture_seconds[f"{kind}/{bucket}"] = time.perf_counter() - t0
        self.stats.memory_bytes = _pool_bytes(self.device) - before
        if self.lora is not None:
            self.lora.reset_lora_batch()
        return self

    def _forward_of(self, batch: ForwardBatch):
        model, kv = self.runner.model, self.runner.kv

        def forward() -> torch.Tensor:
            return model(batch, kv)

        return forward

    # -- replay -------------------------------------------------------------------------------
    @property
    def mode(self) -> ForwardMode:
        return self.buffers.mode

    @property
    def buckets(self) -> list[int]:
        return self.buffers.buckets

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        return self.buffers.bucket_for(batch)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether a captured bucket fits the batch (False before ``capture()``)."""
        return bool(self.graphs) and self.buffers.bucket_for(batch) is not None

    def variant_for(self, batch: ForwardBatch, step_has_adapters: bool) -> str:
        """The variant this rank replays when the step (every rank's rows) does or does not
        have adapters: ``peers`` where this rank's own rows have none and it was captured."""
        if self.lora is None or not step_has_adapters:
            return BASE
        if batch.has_adapters or (PEERS, self.buffers.buckets[0]) not in self.graphs:
            return LORA
        return PEERS

    def replay(self, batch: ForwardBatch, bucket: int | None = None,
               variant: str | None = None) -> torch.Tensor:
        """Logits of the batch's requests. The tensor is a view of a static output: valid
        until the next replay. Under DP attention the step agreement fixes ``bucket`` and
        ``variant`` (the same on every rank, whatever this rank's own batch holds)."""
        own = self.buffers.bucket_for(batch)
        bucket = own if bucket is None else bucket
        idle = batch.mode is ForwardMode.IDLE
        # Hazard: a batch no bucket holds (own None: too many tokens or requests, a prefix past
        # max_prefix, a wider context) must be refused under an agreed bucket too; only an
        # idle batch fits every bucket (a prefill runner's has no own bucket). A bucket that is
        # not an integer (2.0, True) matched one and failed in a slice after LoRA was prepared.
        if (not is_int(bucket) or bucket not in self.buffers.buckets
                or (own is None and not idle) or (own or 0) > bucket):
            raise ValueError(f"no captured bucket fits this {batch.mode.value} batch of "
                             f"{batch.batch_size} requests, {batch.num_tokens} tokens: "
                             f"{self._misfit(batch, own, bucket)} (buckets "
                             f"{self.buffers.buckets}, asked {bucket!r}); check can_run() "
                             "first and run the batch eagerly where it is False")
        bucket = int(bucket)
        # Under DP the sharded MLP serves every rank's rows: the step has adapters where any
        # rank's rows do (a rank whose own rows were base-only replayed "base" and left its
        # shard of its peers' MLP LoRA out, silently); an idle rank without ``gathered`` is
        # taken to serve adapter rows.
        step_lora = (batch.gathered.has_adapters if batch.gathered is not None
                     else (idle and self.dp is not None) or batch.has_adapters)
        kind = variant if variant is not None else self.variant_for(batch, step_lora)
        if kind != LORA and variant is not None and self.lora is not None and batch.has_adapters:
            raise ValueError(f"variant {kind!r} would drop the LoRA of this batch's adapter rows "
                             f"{sorted({n for n in batch.adapter_names if n is not None})}: "
                             f"replay it as {LORA!r} (or leave variant to variant_for)")
        if kind == BASE and self.lora is not None and batch.gathered is not None and (
                batch.gathered.has_adapters):
            raise ValueError(f"variant {kind!r} would drop the LoRA of the peers' adapter rows "
                             "that this rank's MLP shard serves: replay the step's agreed "
                             f"variant (variant_for(batch, True)), or leave variant unset")
        check_gathered(batch, self.dp)
        _check_step_mode(batch, self.mode)
        if batch.gathered is not None and batch.gathered.rows_per_rank != self.buffers.rows(bucket):
            raise ValueError(f"the step agreed on {batch.gathered.rows_per_rank} rows per rank "
                             f"but bucket {bucket} holds {self.buffers.rows(bucket)}")
        if (kind, bucket) not in self.graphs:
            raise RuntimeError(
                f"no {kind!r} graph of bucket {bucket} was captured "
                + ("(call capture() before replay())" if not self.graphs else
                   f"(captured: {sorted(self.graphs)})"))
        if not idle:
            check_index_tensors(batch)
        lora_batch = batch if not idle or batch.gathered is not None else None
        self._set_lora(kind, lora_batch, bucket)  # may raise: before any write
        with phase("buffer refresh"):
            self.buffers.write(None if idle else batch, bucket)
        self.last_kind, self.last_bucket = kind, bucket
        with phase("replay"):
            out = self.graphs[(kind, bucket)].replay()
        return out[: batch.batch_size]

    def _misfit(self, batch: ForwardBatch, own: int | None, bucket) -> str:
        if own is None and batch.mode is not ForwardMode.IDLE:
            return self.buffers.misfit(batch)
        if bucket is None:  # idle on a prefill runner
            return "an idle batch fits every bucket: name one, replay(batch, bucket)"
        if not is_int(bucket) or bucket not in self.buffers.buckets:
            return "the asked bucket is not one of the buckets"
        return f"it needs bucket {own}"

    def _set_lora(self, kind: str, batch: ForwardBatch | None, bucket: int,
                  capture: bool = False) -> None:
        if self.lora is None:
            return
        if kind == BASE:
            self.lora.reset_lora_batch()
            return
        rows, requests = self.buffers.rows(bucket), self.buffers.requests(bucket)
        local = kind == LORA
        if capture:
            self.lora.prepare_for_capture(self.lora_buffers, rows, requests, local)
        else:
            self.lora.prepare_for_replay(self.lora_buffers, batch, rows, requests, local)


def _check_step_mode(batch: ForwardBatch, mode: ForwardMode) -> None:
    """Refuses, before any LoRA planning, a step whose gathered rows are of the other mode:
    its gathered layout is planned in that mode's blocks, which this runner's static layout
    does not hold (the refusal came after the plan had moved adapters into slots, as "plan
    has block_m=64, layout needs 16")."""
    g = batch.gathered
    if g is not None and g.mode is not mode:
        raise ValueError(f"batch.gathered.mode is {g.mode.value}, but this is a {mode.value} "
                         f"graph runner: replay the step on the {g.mode.value} runner (a step "
                         "that mixes decode and extend rows runs eagerly)")


def _device_of(runner: ModelRunner) -> torch.device:
    """The runner's device; a model (or an engine) given for the runner raised
    "'LlamaForCausalLM' object has no attribute 'device'"."""
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"GraphRunner.decode / .prefill take the ModelRunner whose model and KV "
                        f"cache they replay, got {type(runner).__name__}: build it as "
                        "ModelRunner(model, KVCache(...), lora)")
    return runner.device


def _pool_bytes(device: torch.device) -> int:
    """Reserved device memory once the allocator's cache is released: what remains beyond
    live tensors is held by graph pools (capture itself empties the cache, so a plain
    before/after difference of ``memory_reserved`` would mislead)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
