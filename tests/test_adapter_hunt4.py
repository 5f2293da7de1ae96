"""Adapter pool, fourth hunt: a ``LoRAConfig`` size given as a numpy integer (``np.max`` of
the adapters' ranks) was accepted and kept as numpy, and the first Triton LoRA launch then
failed with ``'numpy.int64' object has no attribute 'bit_length'``."""

from __future__ import annotations

import numpy as np
import pytest
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


def test_random_adapter_refuses_a_rank_below_one_or_not_an_integer():
    # rank 0 raised ZeroDivisionError computing the scaling
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="rank must be an integer >= 1"):
            random_adapter(CFG, "a", bad, ("q_proj",))


def test_pin_and_unload_name_a_non_string_name_and_leave_the_pool_as_it_was():
    # a list name raised "unhashable type: 'list'" from the membership test
    runner = make_runtime(CFG, dtype=torch.float32, device=DEVICE, targets=("q_proj",))
    runner.lora.load_adapter("a", random_adapter(CFG, "a", 4, ("q_proj",)))
    for call in (lambda: runner.lora.pin_adapter(["a"]),
                 lambda: runner.lora.unload_adapter(["a"]),
                 lambda: runner.lora.unload_adapter({"a": 1})):
        with pytest.raises(KeyError, match="an adapter name is a string"):
            call()
    assert sorted(runner.lora.adapters) == ["a"] and not runner.lora.pool.pinned
    runner.lora.pin_adapter("a")
    assert runner.lora.pool.pinned == {"a"}
