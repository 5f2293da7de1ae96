"""A decode serving world for the host-path benchmarks: a tiny-preset model (the host path
depends on batch size, context and adapter count, not on hidden size), ``adapters`` random
adapters of rank ``rank`` in as many slots, a decode graph runner captured at the benchmarked
batch sizes (on a CPU the traced stand-in, as in the tests), and for each batch size that many
running requests with ``context`` tokens cached, spread round-robin over the adapters.

Every use of the runtime's APIs by ``bench/host/`` is here, so a change of those APIs is
adapted in this file alone."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from graphs import GraphRunner
from graphs.replayable import Replayable
from graphs.runner import LORA
from lora_runtime.engine.forward_batch import ForwardBatch
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode
from lora_runtime.engine.scheduler import Scheduler, SchedulerConfig
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.batch_info import LoRABatchPlan
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM
from lora_runtime.model.modules import LINEAR_TARGETS

REPLAY_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class HostShape:
    batch_sizes: tuple[int, ...] = (1, 64, 256)
    adapters: int = 16
    rank: int = 16
    context: int = 256
    """Tokens each request has cached (the block table a decode batch carries grows with it)."""
    layers: int = 1
    targets: tuple[str, ...] = LINEAR_TARGETS
    """LoRA target modules. The host path does not depend on them (planning and refresh are
    per batch, not per module); fewer make the capture, the costly part of setting up, faster."""

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}")
        for name in ("adapters", "rank", "context", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"HostShape.{name} must be >= 1, got {getattr(self, name)}")


class _NoReplay(Replayable):
    """Stands in for a captured graph: the host path of a step runs, the replay does not."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output

    def replay(self) -> torch.Tensor:
        return self.output


class HostWorld:
    def __init__(self, shape: HostShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        cuda = device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        config = tiny(shape.layers)
        model = LlamaForCausalLM.random(config, self.dtype, device)
        self.lora = LoRAManager(model, LoRAConfig(shape.adapters, shape.rank, shape.targets,
                                                  backend="triton" if cuda else "torch"))
        self.names = [f"host{i}" for i in range(shape.adapters)]
        for i, name in enumerate(self.names):
            self.lora.load_adapter(name, random_adapter(config, name, shape.rank, shape.targets,
                                                        seed=i, dtype=self.dtype))
        per_request = shape.context + 1
        self.kv = KVCache(config, sum(shape.batch_sizes) * per_request, self.dtype, device)
        self.runner = ModelRunner(model, self.kv, self.lora)
        with self._base_kernels():
            self.graphs = GraphRunner.decode(self.runner, list(shape.batch_sizes),
                                             per_request).capture()
        gen = torch.Generator().manual_seed(0)
        self.schedulers = {bs: self._running(bs, config.vocab_size, gen)
                           for bs in shape.batch_sizes}

    def _base_kernels(self):
        """CPU tensors take the torch base step even on a GPU host (whose default is Triton,
        which cannot read CPU tensors)."""
        return use_base_backend("torch") if self.device.type == "cpu" else contextlib.nullcontext()

    def _running(self, bs: int, vocab: int, gen: torch.Generator) -> Scheduler:
        """A scheduler whose running set is ``bs`` requests ready to decode: their context is
        cached (slots allocated; the host path never reads the cache) and a token sampled."""
        ctx = self.shape.context
        sched = Scheduler(SchedulerConfig(max_batch_size=bs), self.kv.max_tokens,
                          self.shape.adapters)
        for i in range(bs):
            prompt = torch.randint(0, vocab, (ctx,), generator=gen).tolist()
            req = Request(prompt, self.names[i % len(self.names)], max_new_tokens=2)
            req.kv_slots = self.kv.alloc(ctx)
            req.output.append(int(torch.randint(0, vocab, (1,), generator=gen)))
            sched.running.append(req)
        return sched

    # -- the host path, piece by piece ------------------------------------------------------
    def requests(self, bs: int) -> list[Request]:
        return self.schedulers[bs].running

    def build_batch(self, bs: int) -> ForwardBatch:
        """What the engine does before a forward: schedule the step, build its batch (this
        takes a KV slot per request: ``unbuild`` gives it back)."""
        step = self.schedulers[bs].schedule()
        return build_decode(step.requests, self.kv, self.device)

    def unbuild(self, bs: int) -> None:
        """Undoes ``build_batch``: the requests are ready to decode the same token again."""
        for req in self.requests(bs):
            if len(req.kv_slots) == len(req.tokens):
                self.kv.free([req.kv_slots.pop()])

    def plan(self, batch: ForwardBatch) -> LoRABatchPlan:
        """Slots and every segment plan (plans are lazy: a replay that needs none skips them)."""
        plan = self.lora.plan_lora_batch(batch)
        _ = plan.rows, plan.logits_rows, plan.gathered
        return plan

    def plan_with_slots_rotated(self, plan: LoRABatchPlan) -> LoRABatchPlan:
        """Another layout of as many rows: each adapter row moved to the next adapter's slot."""
        n = self.neutral_slot

        def turn(spec):
            return dataclasses.replace(spec, request_slots=tuple(
                s if s == n else (s + 1) % n for s in spec.request_slots))

        return LoRABatchPlan(turn(plan.rows_spec), turn(plan.logits_spec),
                             None if plan.gathered_spec is None else turn(plan.gathered_spec))

    def prepare_eager(self, batch: ForwardBatch) -> None:
        """The LoRA part of an eager forward's host path: plan and exact-size metadata."""
        self.lora.prepare_lora_batch(batch)

    def refresh_lora(self, plan: LoRABatchPlan, bucket: int) -> None:
        """The LoRA "buffer refresh" phase of a replay: a plan into the static metadata."""
        self.lora.backend.prepare_for_replay(self.graphs.lora_buffers, plan, bucket, bucket)

    def refresh_inputs(self, batch: ForwardBatch, bucket: int) -> None:
        """The model inputs' "buffer refresh" phase of a replay."""
        self.graphs.buffers.write(batch, bucket)

    def graph_step(self, batch: ForwardBatch) -> torch.Tensor:
        """What a serving loop calls per decode step once the batch is built: plan, both
        buffer refreshes, replay (none inside ``replays_skipped``)."""
        if not self.graphs.can_run(batch):
            raise ValueError(f"no captured bucket takes a batch of {batch.batch_size}")
        return self.graphs.replay(batch)

    @contextlib.contextmanager
    def replays_skipped(self):
        """``graph_step`` runs its whole host path but no replay."""
        real = self.graphs.graphs
        vocab = self.runner.model.config.vocab_size
        self.graphs.graphs = {
            key: _NoReplay(torch.zeros(key[1], vocab, device=self.device)) for key in real}
        try:
            yield
        finally:
            self.graphs.graphs = real

    def reset(self) -> HostWorld:
        """Nothing prepared and every request ready to decode, whatever ran before."""
        self.lora.reset_lora_batch()
        for bs in self.shape.batch_sizes:
            self.unbuild(bs)
        return self

    # -- what the checks read ---------------------------------------------------------------
    @property
    def neutral_slot(self) -> int:
        return self.lora.neutral_slot

    def slots_of(self, batch: ForwardBatch) -> list[int]:
        """Each request's adapter slot, from the pool (where the adapter really lives)."""
        return [self.neutral_slot if n is None else self.lora.pool.slot_of[n]
                for n in batch.adapter_names]

    def eager_layouts(self):
        """(token rows, logits rows) layouts the last eager prepare left in the backend."""
        b = self.lora.backend
        return b.batch_info.rows, b.logits_info

    def static_layouts(self):
        """The graph runner's static LoRA metadata (token rows, logits rows), full capacity."""
        bufs = self.graphs.lora_buffers
        return bufs.tokens, bufs.logits

    @property
    def input_buffers(self):
        return self.graphs.buffers

    def replayed_lora_graph(self, bucket: int) -> bool:
        """Whether the last replay (or skipped replay) was the LoRA graph of ``bucket``."""
        return (self.graphs.last_kind, self.graphs.last_bucket) == (LORA, bucket)

    def check_replay_matches_eager(self, batch: ForwardBatch) -> None:
        """One real replay of ``batch`` gives the logits of an eager forward of it."""
        with self._base_kernels():
            replayed = self.graphs.replay(batch).clone()
            eager = self.runner.forward_eager(batch)
        tol = REPLAY_TOL[self.dtype]
        torch.testing.assert_close(replayed.float(), eager.float(), rtol=tol, atol=tol)
