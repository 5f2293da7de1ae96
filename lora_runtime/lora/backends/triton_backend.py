"""LoRA through this project's Triton kernels."""

from __future__ import annotations

from kernels import (
    config,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    lora_shrink_with_delta,
)
from lora_runtime.lora.backends.base import LoRABackend, RowSet


class TritonBackend(LoRABackend):
    name = "triton"

    def fuses_expand(self, x, weights, consumer):
        return self._route(("expand", consumer, x.shape[0], weights.max_rank),
                           lambda: config.expand_in_consumer(x, consumer, weights.max_rank,
                                                             weights.num_slots))

    def shrinks_in_consumer(self, x, weights, consumer, rows=RowSet.TOKENS):
        def decide():
            layout = self.ready_layout(rows)
            blocks = 0 if layout is None else layout.block_slots.shape[0]
            return config.shrink_in_consumer(x, weights.max_rank, consumer, blocks)

        return self._route(("shrink", consumer, x.shape[0], weights.max_rank), decide)

    def _route(self, key, decide):
        """``decide()``, once per key for an eager-prepared forward (its capture and tracer
        checks cost ~7 us a module on the H200 host; ``prepare`` starts a new memo), every
        call otherwise."""
        routes = self.routes
        if routes is None:
            return decide()
        route = routes.get(key)
        if route is None:
            route = routes[key] = decide()
        return route

    def expand_beside(self, x, consumer):
        return config.delta_beside(x, consumer)

    def one_launch(self, x, weights, rows):
        def decide():
            layout = self.ready_layout(rows)
            return layout is not None and config.one_launch_lora(
                x, layout.block_slots.shape[0], layout.block_m, weights.max_rank)

        return self._route(("one_launch", rows, x.shape[0], weights.max_rank), decide)

    def shrink_expand(self, x, weights, y, layout):
        lora_shrink_expand(x, weights, y, layout)

    def shrink(self, x, weights, layout):
        return lora_shrink(x, weights, layout)

    def shrink_with_delta(self, x, weights, layout):
        return lora_shrink_with_delta(x, weights, layout)

    def expand(self, a, weights, y, layout):
        lora_expand(a, weights, y, layout)

    def embedding_shrink(self, token_ids, weights, layout):
        return lora_embedding_shrink(token_ids, weights, layout)
