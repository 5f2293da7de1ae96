"""LoRA through plain torch (gather + bmm): the reference backend, graph-safe, CPU-friendly."""

from __future__ import annotations

from kernels.reference import embedding_shrink_reference, expand_reference, shrink_reference
from lora_runtime.lora.backends.base import LoRABackend


class TorchBackend(LoRABackend):
    name = "torch"

    def shrink(self, x, weights, layout):
        _check_rows(layout, x.shape[0], "shrink")
        return shrink_reference(x, weights, layout)

    def expand(self, a, weights, y, layout):
        _check_rows(layout, y.shape[0], "expand")
        expand_reference(a, weights, y, layout)

    def embedding_shrink(self, token_ids, weights, layout):
        _check_rows(layout, token_ids.shape[0], "embedding")
        return embedding_shrink_reference(token_ids, weights, layout)


def _check_rows(layout, rows: int, what: str) -> None:
    if layout.num_rows != rows:
        raise ValueError(
            f"torch backend {what}: the prepared LoRA metadata covers {layout.num_rows} rows but "
            f"the input has {rows}. The metadata is stale: prepare (or reset) the LoRA batch for "
            "this forward"
        )
