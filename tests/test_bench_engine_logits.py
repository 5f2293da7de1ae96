"""The throughput and DP suites checked an engine's tokens against an eager forward outside
the engine: a token shows only a fault that moves a top-2 margin past the near tie, so the
third request of a decode batch of 4 decoding one position off (throughput), and a DP rank
whose MLP shard is scaled by 1.5 (dp), were verified with every probed token right. The
engine's logits rows at the probed tokens are now compared too (fp32: 1e-4 relative)."""

from __future__ import annotations

import pytest
import torch
from bench_faults import third_request_one_position_off

import bench.token_reference as token_reference
import lora_runtime.engine.engine as engine_module
from bench import dp_bench, throughput_bench
from bench.context import Context
from bench.hardware import Ceilings
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload
from lora_runtime.model.config import PRESETS

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
BASE = throughput_bench.cases("tiny", 1, "float32", 8, 3, 4, [(0, "-")], 4)[0]


@pytest.mark.parametrize("fault", [False, True], ids=["correct", "third-request-off"])
def test_throughput_judges_the_logits_rows(monkeypatch, fault):
    if fault:
        third_request_one_position_off(monkeypatch, engine_module)
    monkeypatch.setattr(throughput_bench, "TIMED_PASSES", 1)
    v = throughput_bench.run_case(BASE, CTX)["verification"]
    if fault:
        assert v["status"] == "failed" and "logits rows" in v["error"], v
    else:
        assert v["status"] == "verified" and token_reference.LOGITS_CHECK in v["checks"], v
        assert v["max_rel_err_logits_vs_eager"] < 1e-5


CONFIG = PRESETS["tiny"](1)
SPEC = WorkloadSpec(4, 6, 3, popularity="none", num_adapters=1, seed=1)
VERIFIED = {"status": "verified", "error": None, "checked": "count"}


def _served():
    """Tokens and probed logits rows of a correct engine (the DP case's weights, seed 0),
    as two ranks of two requests each would report them."""
    model = dp_bench._model(CONFIG, torch.float32, CPU, 0, 8)[0]
    eng = Engine(ModelRunner(model, KVCache(CONFIG, 256, torch.float32, CPU), None),
                 SchedulerConfig(max_batch_size=4), keep_logits=True)
    wl = make_workload(SPEC, CONFIG.vocab_size)
    reqs = [eng.add_request(w.prompt, None, max_new_tokens=w.max_new_tokens) for w in wl]
    eng.run()
    untimed = dict(enumerate(reqs))
    parts = [{i: list(untimed[i].output) for i in (0, 1)},
             {i: list(untimed[i].output) for i in (2, 3)}]
    rows = dp_bench._probe_rows(eng, untimed)
    return parts, [{i: rows[i] for i in (0, 1)}, {i: rows[i] for i in (2, 3)}]


@pytest.mark.parametrize("fault", [False, True], ids=["correct", "rank1-rows-off"])
def test_dp_judges_the_logits_rows(fault):
    parts, rows = _served()
    assert token_reference.REQUESTS >= 2
    if fault:  # rank 1's rows 1% off: no probed token changes
        rows[1] = {i: {k: t * 1.01 for k, t in ks.items()} for i, ks in rows[1].items()}
    v = dp_bench._verify_reference(CONFIG, torch.float32, CPU, 0, 8, SPEC, parts, VERIFIED,
                                   rows)
    if fault:
        assert v["status"] == "failed" and "rank 1" in v["error"], v
        assert "logits rows" in v["error"]
    else:
        assert v["status"] == "verified" and v["max_rel_err_logits_vs_eager"] < 1e-5, v
