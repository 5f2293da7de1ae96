"""The DP suite verified a case by counting its tokens, so a DP runtime whose MLP got another
rank's gathered rows, or whose engine gave tokens to the wrong requests, was verified and its
tokens/s published. Rank 0 now checks every rank's untimed-pass tokens (by workload index)
against an eager forward of an unsharded copy of the model (``dp_bench._verify_reference``);
the ranks run in spawned processes, so this tests that check on tokens served in-process."""

from __future__ import annotations

import pytest
import torch

from bench import dp_bench
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload
from lora_runtime.model.config import PRESETS

CPU = torch.device("cpu")
CONFIG = PRESETS["tiny"](1)
SPEC = WorkloadSpec(4, 6, 3, popularity="uniform", num_adapters=2, seed=1)
VERIFIED = {"status": "verified", "error": None, "checked": "count"}


def served_tokens(spec: WorkloadSpec, kv_tokens: int, max_batch: int) -> list[list[int]]:
    """``spec``'s tokens from a correct engine with a DP case's weights and adapters
    (``dp_bench``'s own builders: seed 0, adapter i seeded i)."""
    model, lora = dp_bench._model(CONFIG, torch.float32, CPU, 2, 8)
    for name in spec.adapter_names:
        lora.load_adapter(name, dp_bench._adapter(CONFIG, name, 8, torch.float32))
    eng = Engine(ModelRunner(model, KVCache(CONFIG, kv_tokens, torch.float32, CPU), lora),
                 SchedulerConfig(max_batch_size=max_batch))
    wl = make_workload(spec, CONFIG.vocab_size)
    return [list(o) for o in eng.generate([w.prompt for w in wl], [w.adapter for w in wl],
                                          max_new_tokens=3)]


@pytest.fixture(scope="module")
def served() -> dict[int, list[int]]:
    return dict(enumerate(served_tokens(SPEC, 256, 4)))


def _check(outs):
    return dp_bench._verify_reference(CONFIG, torch.float32, CPU, 2, 8, SPEC, outs, VERIFIED)


def test_correct_tokens_are_verified(served):
    v = _check(served)
    assert v["status"] == "verified" and v["reference_probes"] == 8


def test_tokens_of_the_wrong_requests_fail(served):
    rotated = {i: served[(i + 1) % len(served)] for i in served}
    v = _check(rotated)
    assert v["status"] == "failed" and "eager forward" in v["error"]


def test_one_wrong_last_token_fails(served):
    bad = {i: list(o) for i, o in served.items()}
    bad[2][-1] = (bad[2][-1] + 1) % CONFIG.vocab_size
    assert _check(bad)["status"] == "failed"
