"""LoRA's bytes floor (``bench.lora_floor``): a step's distinct adapters, each counted once at
its own rank and targets, against bytes summed from the adapters' own tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from runtime_helpers import drawn_adapter, make_runtime

from bench.lora_floor import adapter_bytes, floor_us, pass_floor_ms
from lora_runtime.model.config import tiny


def _own_bytes(adapter) -> int:
    """A and B of every module, but an embedding's A: a step reads only its tokens' rows."""
    return sum((0 if k == (None, "embed_tokens") else m.a.numel() * m.a.element_size())
               + m.b.numel() * m.b.element_size() for k, m in adapter.modules.items())


def test_a_steps_floor_counts_each_distinct_adapter_once():
    config = tiny(2)
    runner = make_runtime(config, dtype=torch.float16, device="cpu", slots=2, max_rank=8)
    adapters = {n: drawn_adapter(config, n, seed, max_rank=8)
                for seed, n in enumerate(("a", "b", "c"))}
    for name, ad in adapters.items():
        runner.lora.load_adapter(name, ad)
    own = {n: _own_bytes(ad.to(torch.float16)) for n, ad in adapters.items()}
    assert len(set(own.values())) == 3, "the drawn adapters differ in rank or targets"
    lora = runner.lora
    assert adapter_bytes(lora, ["a", None, "a", "c"]) == own["a"] + own["c"]
    assert adapter_bytes(lora, [None, None]) == 0
    steps = [SimpleNamespace(adapters=("a", "b")), SimpleNamespace(adapters=()),
             SimpleNamespace(adapters=("c",))]
    gbps = 2.0
    want_ms = sum(own.values()) / (gbps * 1e9) * 1e3
    assert pass_floor_ms(lora, steps, gbps) == pytest.approx(want_ms)
    assert floor_us(4_000, gbps) == pytest.approx(2.0)


def test_an_embedding_adapter_counts_its_b_but_not_its_a_table():
    # A step gathers only its tokens' rows of the [vocab, r] A: the whole table is no floor.
    from runtime_helpers import random_adapter

    config = tiny(2)
    runner = make_runtime(config, dtype=torch.float16, device="cpu", slots=2, max_rank=8)
    for name, targets in (("emb", ["embed_tokens", "o_proj"]), ("o", ["o_proj"])):
        runner.lora.load_adapter(name, random_adapter(config, name, 4, targets, seed=1))
    embed_b = config.hidden_size * 4 * 2
    assert adapter_bytes(runner.lora, ["emb"]) == adapter_bytes(runner.lora, ["o"]) + embed_b
