"""Graph replays against a ninth hunt.

Inference mode: the CPU stand-in's static output was made by its first replay, so a replay
under ``torch.inference_mode()`` left an inference tensor that every later replay outside it
failed to write ("Inplace update to inference tensor outside InferenceMode"), where a CUDA
graph's output, written by its kernels, takes any mode. Runners built or captured under
inference mode allocated their static buffers (model inputs, LoRA metadata) as inference
tensors too: the first refresh outside it raised the same, on a GPU as well.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from runtime_helpers import ALL_TARGETS, make_runtime

from graphs import GraphRunner
from graphs.replayable import capture
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny


def test_a_traced_replay_under_inference_mode_then_outside_it():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    graph = capture(lambda: lin(x), torch.device("cpu"))
    for mode in (True, False, True):
        x.add_(1.0)
        with torch.inference_mode(mode):
            out = graph.replay()
        torch.testing.assert_close(out, lin(x).detach())


@pytest.fixture(scope="module")
def runtime():
    cfg = tiny(1)
    rt = make_runtime(cfg, dtype=torch.float32, device=DEVICE, backend="torch", slots=2,
                      max_rank=4)
    rt.lora.load_adapter("a", random_adapter(cfg, "a", 4, list(ALL_TARGETS), seed=3,
                                             b_std=0.3))
    return rt


def test_runners_built_and_captured_under_inference_mode_replay_outside_it(runtime):
    rt = runtime
    with torch.inference_mode():
        decode = GraphRunner.decode(rt, [1, 2], 16).capture()
        prefill = GraphRunner.prefill(rt, [8], 2, max_prefix=8).capture()
    reqs = [Request([1, 2, 3], "a", 4), Request([4, 5], None, 4)]
    batch = build_extend(reqs, rt.kv, DEVICE)
    eager = rt.forward_eager(batch).clone()
    torch.testing.assert_close(prefill.replay(batch), eager, rtol=1e-4, atol=1e-4)
    for r, row in zip(reqs, eager, strict=True):
        r.output.append(int(row.argmax()))
    batch = build_decode(reqs, rt.kv, DEVICE)
    eager = rt.forward_eager(batch).clone()
    for mode in (False, True, False):
        with torch.inference_mode(mode):
            got = decode.replay(batch)
        assert decode.last_kind == "lora"
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    rt.lora.reset_lora_batch()
    release(reqs, rt.kv)


@pytest.fixture(scope="module")
def small_graphs(runtime):
    """A decode runner of buckets 1 and 2 over 8 context tokens, a prefill runner of 16
    tokens, 2 requests and 4 cached tokens."""
    return (GraphRunner.decode(runtime, [1, 2], max_context=8).capture(),
            GraphRunner.prefill(runtime, [16], 2, max_prefix=4).capture())


def _cached(rt, lens):
    """Requests with ``lens[i]`` tokens in the KV cache and one more token to extend."""
    reqs = [Request(list(range(1, n + 1)), "a" if i == 0 else None, 4)
            for i, n in enumerate(lens)]
    rt.forward_eager(build_extend(reqs, rt.kv, DEVICE))
    for r in reqs:
        r.output.append(7)
    return reqs


@pytest.mark.parametrize("case, says", [
    ("decode context", r"its KV context of 9 tokens exceeds max_context 8"),
    ("decode requests", r"its 3 requests exceed the largest bucket 2"),
    ("prefill prefix", r"its 6 cached tokens exceed max_prefix 4"),
    ("prefill requests", r"its 3 requests exceed max_requests 2"),
    ("prefill tokens", r"its 20 tokens exceed the largest bucket 16"),
])
def test_a_batch_no_bucket_holds_is_refused_naming_why(runtime, small_graphs, case, says):
    """The refusal named the batch's requests and tokens and the buckets alone: a prefill of
    3 tokens refused by a bucket of 16, or a decode of one request by buckets [1, 2], read as
    a bug of the runner (the limit it broke, max_prefix or max_context, went unnamed)."""
    rt = runtime
    decode, prefill = small_graphs
    lens = {"decode context": [8], "decode requests": [2, 2, 2], "prefill prefix": [6],
            "prefill requests": [1, 1, 1], "prefill tokens": [1]}[case]
    reqs = _cached(rt, lens)
    if case == "prefill tokens":
        reqs[0].output += list(range(1, 20))
    graphs = decode if case.startswith("decode") else prefill
    build = build_decode if case.startswith("decode") else build_extend
    batch = build(reqs, rt.kv, DEVICE)
    assert not graphs.can_run(batch)
    rt.lora.reset_lora_batch()
    with pytest.raises(ValueError, match=says):
        graphs.replay(batch)
    with pytest.raises(ValueError, match=says):
        graphs.replay(batch, bucket=graphs.buckets[-1])
    assert rt.lora.backend.batch_info is None
    release(reqs, rt.kv)
