"""Requests as a demanding client sends them: token ids from a tokenizer's tensors, stop ids
of another tokenizer. Each is served, or refused at submission naming the input and the fix,
leaving the engine serving."""

from __future__ import annotations

import numpy
import pytest
import torch
from conftest import DEVICE
from engine_world import EngineWorld

from lora_runtime.engine.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def world():
    return EngineWorld("torch", DEVICE, layers=1, kv_tokens=40)


def test_a_prompt_of_a_tokenizers_tensor_is_served_as_its_list(world):
    """``tokenizer(text, return_tensors="pt").input_ids[0]`` is a 1-D integer tensor: it was
    refused as 'prompt token ids must be integers, got [tensor(1), tensor(2), ...]'."""
    w = world
    eng = w.engine(SchedulerConfig())
    ids = [5, 9, 2, 7]
    want = eng.generate([ids], [None], max_new_tokens=3)[0]
    for prompt in (torch.tensor(ids), torch.tensor(ids, dtype=torch.int32),
                   numpy.asarray(ids, dtype=numpy.int32)):
        req = eng.add_request(prompt, None, max_new_tokens=3,
                              stop_ids=torch.tensor([w.config.vocab_size - 1]))
        assert req.prompt == ids and {type(t) for t in req.prompt} == {int}
        eng.run()
        assert req.output == want[:len(req.output)]
    assert eng.generate(torch.tensor([ids, ids]), [None, None], max_new_tokens=3) == [want] * 2


@pytest.mark.parametrize("prompt, words", [
    (torch.tensor([[5, 9, 2]]), r"one prompt's token ids \(1-D\), got a 2-D Tensor of shape "
                                r"\(1, 3\): .* pass ids\[0\]"),
    (numpy.asarray([[5, 9, 2]]), r"one prompt's token ids \(1-D\), got a 2-D ndarray"),
    (torch.tensor(5), r"one prompt's token ids \(1-D\), got a 0-D Tensor .*\(\[id\] for one\)"),
    (torch.tensor([1.5, 2.0]), "prompt token ids must be integers, got \\[1.5"),
])
def test_a_prompt_tensor_that_is_not_one_prompt_of_ids_is_refused(world, prompt, words):
    eng = world.engine(SchedulerConfig())
    with pytest.raises(ValueError, match=words):
        eng.add_request(prompt, None)
    assert not eng.has_work


def test_token_ids_outside_the_vocabulary_are_refused_naming_them(world):
    """A stop id past the vocabulary (another tokenizer's end-of-sequence id) can never be
    sampled: it was taken, and the request ran to max_new_tokens without stopping. A prompt
    id outside it is refused naming where it sits and the fix."""
    w = world
    eng = w.engine(SchedulerConfig())
    vocab = w.config.vocab_size
    with pytest.raises(ValueError, match=rf"stop_ids \[{vocab}, -1\] .* outside the vocabulary "
                                         rf"0\.\.{vocab - 1} .* model's tokenizer"):
        eng.add_request([1, 2], None, stop_ids=[3, vocab, -1])
    with pytest.raises(ValueError, match=rf"prompt token ids \[{vocab}\] at positions \[1\] are "
                                         rf"outside the vocabulary .* model's tokenizer"):
        eng.add_request([1, vocab, 3], None)
    assert not eng.has_work
    ok = eng.add_request([1, 2], None, max_new_tokens=2, stop_ids=[vocab - 1])
    eng.run()
    w.check_request(eng, ok)
