"""The base step's floor counts what a step reads and computes, nothing else."""

from __future__ import annotations

import torch

from bench.hardware import Ceilings
from bench.step_floor import StepFloor
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM


def test_floor_counts_matrices_kv_and_embedding_rows_only():
    model = LlamaForCausalLM.empty(tiny(2), torch.float32, "cpu")
    c = model.config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    floor = StepFloor.of(model)
    assert floor.matrix_params == 2 * per_layer + (head or c.vocab_size * c.hidden_size)
    assert floor.bytes(3, 10) == 4 * (floor.matrix_params + 3 * c.hidden_size
                                      + 3 * 10 * 2 * 2 * c.kv_size)
    # Memory-bound at bs=1, compute-bound when FLOPs outrun bytes: the roofline takes the max.
    ceil = Ceilings("x", copy_gbps=1000.0, matmul_tflops=1.0, l2_bytes=0)
    small, big = floor.us(1, 10, ceil), floor.us(10**4, 10, ceil)
    assert not small["gemms_compute_bound"] and big["gemms_compute_bound"]
    assert abs(small["roofline_floor_us"] - small["bytes_floor_us"]) < 1e-9
    assert big["roofline_floor_us"] > big["bytes_floor_us"]


def test_a_lora_wrapped_model_reads_the_same_matrices_and_not_the_embedding_table():
    import dataclasses

    from runtime_helpers import ALL_TARGETS, make_runtime

    from bench.step_floor import matrix_bytes

    for tied in (False, True):
        cfg = dataclasses.replace(tiny(2), tie_word_embeddings=tied)
        plain = LlamaForCausalLM.empty(cfg, torch.float32, "cpu")
        wrapped = make_runtime(cfg, dtype=torch.float32, device="cpu", backend="torch",
                               slots=2, max_rank=4, targets=ALL_TARGETS).model
        table = cfg.vocab_size * cfg.hidden_size * 4
        every = sum({id(p): p.numel() * 4 for p in plain.parameters() if p.dim() == 2}.values())
        assert matrix_bytes(plain)[0] == every - (0 if tied else table)
        assert matrix_bytes(wrapped) == matrix_bytes(plain)
