"""Graph-runner and engine arguments a caller gets slightly wrong, each refused at once naming
the input (nothing prepared, nothing replayed), and the unusual ones that must work.

Before: bucket lists given as a generator raised IndexError (the check used it up), one bucket
as an int "'int' object is not iterable", a tensor "Boolean value of Tensor ... ambiguous";
numpy sizes were kept as numpy (``last_bucket`` and the buckets a run records were not
JSON-serializable); ``replay(batch, bucket=2.0)`` prepared the LoRA batch, then failed in a
slice ("slice indices must be integers"), and ``bucket=True`` replayed bucket 1;
``Engine(runner, config, graph_runner)`` (one runner, not in a list) raised "'GraphRunner'
object is not iterable", ``graphs=[runner]`` "'ModelRunner' object has no attribute
'runner'"."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from conftest import DEVICE
from runtime_helpers import drawn_adapter, make_runtime

from graphs import GraphRunner
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.model.config import tiny


@functools.cache
def _runtime():
    cfg = tiny(1)
    rt = make_runtime(cfg, dtype=torch.float32, device=DEVICE, backend="torch", slots=2,
                      max_rank=4, kv_tokens=64)
    rt.lora.load_adapter("a", drawn_adapter(cfg, "a", 1, 4))
    return rt


@pytest.mark.parametrize("buckets, says", [
    ((b for b in (1, 2)), None),  # a generator: IndexError
    (4, r"got 4 \(for one bucket: \[4\]\)"),  # 'int' object is not iterable
    ("12", "got '12'"),
    (torch.tensor([[1, 2]]), "got \\[\\[1, 2\\]\\]"),
])
def test_bucket_lists_in_another_form_are_read_or_refused_naming_them(buckets, says):
    rt = _runtime()
    if says is None:
        assert GraphRunner.decode(rt, buckets, 16).buckets == [1, 2]
        return
    with pytest.raises(ValueError, match=rf"graph buckets must be .*{says}"):
        GraphRunner.decode(rt, buckets, 16)


@pytest.mark.parametrize("buckets", [range(1, 3), torch.tensor([2, 1]), np.array([1, 2, 2]),
                                     [np.int64(2), np.int32(1)], {2, 1}])
def test_bucket_lists_of_any_integer_kind_are_kept_as_python_ints(buckets):
    rt = _runtime()
    g = GraphRunner.decode(rt, buckets, np.int64(16))
    assert g.buckets == [1, 2] and all(type(b) is int for b in g.buckets)
    assert type(g.buffers.max_context) is int
    p = GraphRunner.prefill(rt, buckets, np.int64(2), np.int64(4))
    assert [type(x) for x in (*p.buckets, p.buffers.max_requests, p.buffers.max_prefix)] \
        == [int] * 4
    json.dumps({"buckets": g.buckets, "max_context": g.buffers.max_context})


def test_replay_refuses_a_bucket_that_is_not_an_integer_before_preparing_lora():
    rt = _runtime()
    g = GraphRunner.decode(rt, [1, 2], 16).capture()
    r = Request([1, 2, 3], "a", 4)
    rt.forward_eager(build_extend([r], rt.kv, DEVICE))
    r.output.append(5)
    batch = build_decode([r], rt.kv, DEVICE)
    eager = rt.forward_eager(batch).clone()
    try:
        for bad in (2.0, True, "2"):
            rt.lora.reset_lora_batch()
            with pytest.raises(ValueError, match=rf"asked {bad!r}"):
                g.replay(batch, bad)
            assert rt.lora.backend.batch_info is None and g.last_bucket is None
        got = g.replay(batch, np.int64(2))
        assert type(g.last_bucket) is int and g.last_bucket == 2
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    finally:
        rt.lora.reset_lora_batch()
        release([r], rt.kv)


@pytest.mark.parametrize("graphs, says", [
    ("runner", r"graphs must be a list of graph runners .*got GraphRunner.*graphs=\[g\]"),
    ("model runner", r"graphs\[0\] is a ModelRunner, not a graph runner"),
    ("int", r"graphs must be a list of graph runners .*got int 3"),
])
def test_engine_graphs_that_are_not_a_list_of_graph_runners_are_refused(graphs, says):
    rt = _runtime()
    g = GraphRunner.decode(rt, [1], 16)
    given = {"runner": g, "model runner": [rt], "int": 3}[graphs]
    with pytest.raises(TypeError, match=says):
        Engine(rt, SchedulerConfig(), given)
    assert Engine(rt, SchedulerConfig(), None).graphs == []
    assert Engine(rt, SchedulerConfig(), (g,)).graphs == [g]


def test_a_graph_runner_of_something_else_than_a_model_runner_is_refused():
    """``GraphRunner.decode(model, ...)`` raised "'LlamaForCausalLM' object has no attribute
    'device'"."""
    rt = _runtime()
    for bad in (rt.model, Engine(rt, SchedulerConfig())):
        with pytest.raises(TypeError, match=rf"take the ModelRunner .*got {type(bad).__name__}"):
            GraphRunner.decode(bad, [1], 16)
        with pytest.raises(TypeError, match=rf"take the ModelRunner .*got {type(bad).__name__}"):
            GraphRunner.prefill(bad, [8], 2)
