"""Adapter pool, fourth hunt: a ``LoRAConfig`` size given as a numpy integer (``np.max`` of
the adapters' ranks) was accepted and kept as numpy, and the first Triton LoRA launch then
failed with ``'numpy.int64' object has no attribute 'bit_length'``."""

from __future__ import annotations

import numpy as np
import torch
from conftest import DEVICE
from runtime_helpers import make_runtime, merged_model, reference_logits

from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.model.config import tiny

CFG = tiny(1)


def test_numpy_sizes_are_kept_as_ints_and_serve_on_the_triton_backend():
    cfg = LoRAConfig(np.int64(2), np.int32(8))
    assert type(cfg.max_loras_per_batch) is int and type(cfg.max_rank) is int
    ranks = np.array([3, 8])
    runner = make_runtime(CFG, dtype=torch.float32, device=DEVICE, backend="triton",
                          slots=np.int64(2), max_rank=ranks.max(), targets=("q_proj", "o_proj"))
    ad = random_adapter(CFG, "a", int(ranks[0]), ("q_proj", "o_proj"), seed=1, b_std=0.3)
    runner.lora.load_adapter("a", ad)
    prompt = [3, 1, 4, 1, 5]
    reqs = [Request(prompt, "a"), Request(prompt, None)]
    logits = runner.forward_eager(build_extend(reqs, runner.kv, DEVICE))
    release(reqs, runner.kv)
    ref = reference_logits(merged_model(runner.model, ad), prompt, torch.float32, DEVICE)
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)
