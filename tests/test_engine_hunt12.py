"""Twelfth hunt, the engine's area: KV slots that are not integers, chunk sizes that are not
one integer >= 1 a request, an engine built on something but a ModelRunner, and a shared
``max_new_tokens`` blamed on the first prompt."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_runtime

from lora_runtime.engine.engine import Engine
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.requests import Request, build_extend
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.model.config import tiny


@pytest.mark.parametrize("bad", [[1.5], [2, 2.0 + 0.5], [True]], ids=["float", "mixed", "bool"])
def test_a_kv_free_of_a_slot_that_is_not_an_integer_is_refused(bad):
    """``free([1.5])`` passed every check: the free list grew past the slots held back, and
    ``alloc`` handed out 1.5, read as slot 1, which a request still held."""
    kv = KVCache(tiny(1), 4, torch.float32, "cpu")
    held = kv.alloc(2)
    with pytest.raises(ValueError, match="must be integers"):
        kv.free(bad)
    assert kv.free_slots == 2
    rest = kv.alloc(2)
    assert all(type(s) is int for s in rest) and not set(rest) & set(held)


@pytest.mark.parametrize("n", [-2, 2.5, None])
def test_a_kv_alloc_of_no_slot_count_is_refused(n):
    """``alloc(-2)`` returned no slot and ``alloc(2.5)`` failed in a slice, naming neither."""
    kv = KVCache(tiny(1), 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="alloc takes a number of slots"):
        kv.alloc(n)
    assert kv.free_slots == 4


@pytest.mark.parametrize("limits", [[-1, 2], [2.5, 2], [3]], ids=["negative", "float", "short"])
def test_build_extend_refuses_chunk_sizes_that_are_not_one_integer_a_request(limits):
    """A negative limit cut the prompt's last token off the chunk, silently (prompt [1, 2, 3]
    with -1 built the chunk [1, 2]); a list short of a request raised IndexError."""
    kv = KVCache(tiny(1), 16, torch.float32, "cpu")
    first, second = Request([1, 2, 3]), Request([4, 5])
    with pytest.raises(ValueError, match="limits must give each of the 2 requests"):
        build_extend([first, second], kv, "cpu", limits)
    assert kv.free_slots == 16 and len(first.kv_slots) == len(second.kv_slots) == 0


def test_an_engine_built_on_something_but_a_model_runner_names_the_fix():
    """``Engine(model)`` raised "'LlamaForCausalLM' object has no attribute 'lora'"."""
    runner = make_runtime(tiny(1), dtype=torch.float32, device="cpu", backend="torch",
                          slots=1, max_rank=8, kv_tokens=16)
    for bad in (runner.model, runner.kv, None):
        with pytest.raises(TypeError, match=r"runner must be a ModelRunner.*ModelRunner\(model"):
            Engine(bad)
    assert Engine(runner).runner is runner


def test_add_requests_names_a_bad_max_new_tokens_as_its_own_not_the_first_prompts():
    """The budget is shared by every prompt, but its refusal read "add_requests: prompt 0:
    max_new_tokens must be ...", as if the first prompt were at fault."""
    runner = make_runtime(tiny(1), dtype=torch.float32, device="cpu", backend="torch",
                          slots=1, max_rank=8, kv_tokens=16)
    eng = Engine(runner, SchedulerConfig())
    with pytest.raises(ValueError, match="^add_requests: max_new_tokens must be an integer"):
        eng.add_requests([[1, 2], [3]], [None, None], max_new_tokens=0)
    assert not eng.has_work
