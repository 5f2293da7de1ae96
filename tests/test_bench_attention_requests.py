"""The attention suite's check must see a fault that spares request 0: it compared request 0
alone with the fp32 reference, so attention that reads one slot off for every later request
(an index offset at request boundaries) was verified and timed."""

from __future__ import annotations

import pytest
import torch

from bench import attention_bench
from bench.attention_bench import AttentionCase, measure_case
from bench.hardware import Ceilings
from lora_runtime.engine.forward_batch import DecodeAttention

CPU = torch.device("cpu")
CEIL = Ceilings("cpu", 10.0, 0.1, 0)
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16}
real = attention_bench.decode_attention_reference


def _off_by_one_after_first(q, k, v, meta, scale):
    """Requests b > 0 read their keys one slot early (the previous request's last key)."""
    table = meta.kv_indices.clone()
    table[1:] -= 1
    return real(q, k, v, DecodeAttention(table, meta.kv_lens), scale)


@pytest.mark.parametrize("requests", [2, 5])
def test_a_fault_in_a_later_request_fails_the_case(monkeypatch, requests):
    monkeypatch.setattr(attention_bench, "decode_attention_reference", _off_by_one_after_first)
    case = AttentionCase("decode", requests, 48, 0, "torch", dtype="float32", **SHAPE)
    with pytest.raises(AssertionError, match="request [1-9]"):
        measure_case(case, CPU, CEIL, reps=1)


@pytest.mark.parametrize("case", [
    AttentionCase("decode", 3, 48, 0, "torch", dtype="float32", **SHAPE),
    AttentionCase("prefill", 3, 16, 16, "torch", dtype="float16", **SHAPE)])
def test_correct_attention_passes_for_every_checked_request(case):
    _, derived = measure_case(case, CPU, CEIL, reps=1)
    assert derived["rel_err"] < 5e-3
    assert attention_bench.checked_requests(case) == [0, 1, 2]
