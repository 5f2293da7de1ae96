"""A small serving world for graph-replay schedule tests: a tiny model with LoRA, eager and
graph runners over the same weights and KV cache, and the checks every replay must pass."""

from __future__ import annotations

import torch
from runtime_helpers import (
    ALL_TARGETS,
    drawn_adapter,
    make_runtime,
    merged_model,
    reference_logits,
)

from graphs import GraphRunner
from graphs.runner import BASE, LORA
from lora_runtime.engine.forward_batch import ForwardBatch
from lora_runtime.model.config import tiny

DECODE_BUCKETS, PREFILL_BUCKETS = [1, 2, 4, 8], [8, 16, 32]
MAX_CONTEXT, MAX_PREFILL_REQUESTS, SLOTS, MAX_RANK = 48, 4, 3, 8
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class World:
    def __init__(self, backend: str, device, dtype=torch.float32, layers: int = 2) -> None:
        self.device, self.dtype = device, dtype
        self.config = tiny(layers)
        self.runner = make_runtime(self.config, dtype=dtype, device=device, backend=backend,
                                   slots=SLOTS, max_rank=MAX_RANK, targets=ALL_TARGETS,
                                   kv_tokens=2048)
        self.lora = self.runner.lora
        self.reset()
        self.decode = GraphRunner.decode(self.runner, DECODE_BUCKETS, MAX_CONTEXT).capture()
        self.prefill = GraphRunner.prefill(self.runner, PREFILL_BUCKETS,
                                           MAX_PREFILL_REQUESTS).capture()
        self.replays = 0
        self.idle_replays = 0
        self.oracle_checks = 0
        self._merged: dict[str | None, object] = {}

    def reset(self) -> None:
        """The same four adapters, nothing pinned, nothing prepared (each schedule starts
        here, so a schedule depends only on its own draws)."""
        self.lora.reset_lora_batch()
        self.runner.kv.reset()
        self._merged = {}
        for name in list(self.lora.adapters):
            self.lora.unload_adapter(name)
        self.serial = 0
        for _ in range(4):
            self.new_adapter(seed=self.serial)

    def new_adapter(self, seed: int, pinned: bool = False) -> str:
        name = f"ad{self.serial}"
        self.serial += 1
        self.lora.load_adapter(name, drawn_adapter(self.config, name, seed, MAX_RANK),
                               pinned=pinned)
        return name

    def check_oracle(self, tokens: list[int], adapter: str | None, logits: torch.Tensor) -> None:
        """The served logits of one request equal a from-scratch forward of its whole
        sequence through a dense model merged with its adapter: catches wrong KV contents
        and wrong slot contents, which eager and replay would share."""
        if adapter not in self._merged:
            self._merged[adapter] = merged_model(
                self.runner.model, None if adapter is None else self.lora.adapters[adapter])
        ref = reference_logits(self._merged[adapter], tokens, self.dtype, self.device)
        tol = TOL[self.dtype]
        torch.testing.assert_close(logits, ref, rtol=tol, atol=tol,
                                   msg=lambda m: f"served logits differ from the merged dense "
                                   f"model (adapter {adapter}): {m}")
        self.oracle_checks += 1

    def graph_for(self, batch: ForwardBatch) -> GraphRunner | None:
        for g in (self.decode, self.prefill):
            if g.can_run(batch):
                return g
        return None

    def check_step(self, batch: ForwardBatch) -> torch.Tensor:
        """Eager forward, then the graph replay of the same batch: same logits, neutral
        static metadata past the batch. Returns the eager logits."""
        eager = self.runner.forward_eager(batch).clone()
        graph = self.graph_for(batch)
        if graph is None:
            return eager
        got = graph.replay(batch)
        tol = TOL[self.dtype]
        torch.testing.assert_close(got, eager, rtol=tol, atol=tol,
                                   msg=lambda m: f"replay differs from eager ({graph.last_kind} "
                                   f"graph, {batch.mode.value}, adapters "
                                   f"{batch.adapter_names}): {m}")
        want_kind = LORA if batch.has_adapters else BASE
        assert graph.last_kind == want_kind, f"replayed the {graph.last_kind} graph"
        if graph.last_kind == LORA:
            self.assert_neutral_past(graph, batch.num_tokens, batch.batch_size)
        self.replays += 1
        return eager

    def check_idle(self) -> None:
        """An idle replay (LoRA graph, neutral metadata) computes exactly the base graph."""
        idle = ForwardBatch.idle(self.lora, self.device)
        assert self.lora.backend.batch_info is None
        assert self.runner.forward_eager(idle).shape[0] == 0
        self.decode.replay(idle, variant=LORA)  # what an idle DP rank replays
        assert self.decode.last_kind == LORA
        self.assert_neutral_past(self.decode, 0, 0)
        bucket = DECODE_BUCKETS[0]
        with_lora = self.decode.graphs[(LORA, bucket)].replay().clone()
        base = self.decode.graphs[(BASE, bucket)].replay()
        assert torch.equal(with_lora, base), "an idle replay must not apply any LoRA"
        self.idle_replays += 1

    def assert_neutral_past(self, graph: GraphRunner, rows: int, requests: int) -> None:
        bufs = graph.lora_buffers
        neutral = self.lora.neutral_slot
        for layout, used in ((bufs.tokens, rows), (bufs.logits, requests)):
            full = layout.view(layout.max_rows)
            assert (full.token_slots[used:] == neutral).all(), "padding rows must be neutral"
            live = full.block_ends > full.block_starts
            assert (full.block_slots[~live] == neutral).all(), "unused blocks must be neutral"
        assert self.lora.backend.batch_info is not None or graph.last_kind == BASE
