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
        embed = model.model.embed_tokens.weight
        seen, params, nbytes = set(), 0, 0
        for p in model.parameters():
            if p.dim() != 2 or p is embed and p is not model.lm_head.weight or id(p) in seen:
                continue
            seen.add(id(p))
            params += p.numel()
            nbytes += p.numel() * p.element_size()
        c = model.config
        return StepFloor(nbytes, params, c.hidden_size * embed.element_size(),
                         2 * c.num_layers * c.kv_size * embed.element_size())

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
