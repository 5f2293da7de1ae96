"""The floor of a base decode step: what the hardware allows for its bytes and its FLOPs.

Bytes read once per step: every matrix the step multiplies by (the layers' projections and
the lm_head; the embedding table is not read, only ``bs`` of its rows) and every request's
K/V. The GEMMs' FLOPs (``2 * bs * params``) become the bound once ``bs`` exceeds the
machine's FLOP/byte ratio (~190 on an H200 in bf16): at bs=256 a step's projections are
compute-bound, and a floor of bytes alone could not be reached by any implementation.

    bytes floor     = (matrix bytes + embedding rows + K/V bytes) / copy bandwidth
    roofline floor  = max(matrix bytes / copy bandwidth, GEMM FLOPs / matmul rate)
                      + (embedding rows + K/V bytes) / copy bandwidth
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.hardware import Ceilings
from lora_runtime.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StepFloor:
    matrix_bytes: int
    matrix_params: int
    embed_row_bytes: int
    kv_token_bytes: int
    """K and V of one token over all layers."""

    @staticmethod
    def of(model: LlamaForCausalLM) -> StepFloor:
        nbytes, params = matrix_bytes(model)
        c = model.config
        size = _weight(model.model.embed_tokens).element_size()
        return StepFloor(nbytes, params, c.hidden_size * size, 2 * c.num_layers * c.kv_size * size)

    def bytes(self, bs: int, context: int) -> int:
        return self.matrix_bytes + bs * (self.embed_row_bytes + context * self.kv_token_bytes)

    def us(self, bs: int, context: int, ceil: Ceilings) -> dict:
        """``bytes_floor_us``, ``roofline_floor_us`` and whether the GEMMs are compute-bound."""
        per_byte_us = 1 / (ceil.copy_gbps * 1e3)
        gemm_bytes_us = self.matrix_bytes * per_byte_us
        gemm_flops_us = 2 * bs * self.matrix_params / (ceil.matmul_tflops * 1e6)
        rest_us = bs * (self.embed_row_bytes + context * self.kv_token_bytes) * per_byte_us
        return {"bytes_floor_us": self.bytes(bs, context) * per_byte_us,
                "roofline_floor_us": max(gemm_bytes_us, gemm_flops_us) + rest_us,
                "gemms_compute_bound": gemm_flops_us > gemm_bytes_us}


def matrix_bytes(model: LlamaForCausalLM) -> tuple[int, int]:
    """``(bytes, params)`` of the weight matrices a forward reads whole: the layers'
    projections and the lm_head, wrapped by LoRA layers or not. The embedding table counts
    only where it is the lm_head's (tied): otherwise a forward reads just its batch's rows."""
    embed, head = _weight(model.model.embed_tokens), _weight(model.lm_head)
    seen, params, nbytes = set(), 0, 0
    for p in model.parameters():
        if p.dim() != 2 or p is embed and p is not head or id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        nbytes += p.numel() * p.element_size()
    return nbytes, params


def _weight(module) -> torch.Tensor:
    """A layer's weight, under its LoRA wrapper (``.base``) or not."""
    return getattr(module, "base", module).weight
