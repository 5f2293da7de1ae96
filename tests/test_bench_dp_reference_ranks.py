"""The DP reference probed the workload's first 16 requests only. Under the skewed load
(rank 0 takes 85%) those are nearly all rank 0's: at DP size 4, rank 3 serves none of them,
so every token of rank 3 could be wrong and the case verified (and at size 2, rank 1's 2
requests give 4 probes, within the bf16 allowance of 32 // 8). ``_verify_reference`` now
takes each rank's tokens (what ``_case`` gathers) and probes and judges every rank."""

from __future__ import annotations

import pytest
import torch
from test_bench_dp_reference import served_tokens

from bench import dp_bench
from bench.token_reference import REQUESTS
from lora_runtime.dp.controller import DPController
from lora_runtime.engine.workload import WorkloadSpec, make_workload
from lora_runtime.model.config import PRESETS

CPU = torch.device("cpu")
CONFIG = PRESETS["tiny"](1)
SIZE = 4
SPEC = WorkloadSpec(10 * SIZE, 6, 3, popularity="uniform", num_adapters=2, seed=1)
VERIFIED = {"status": "verified", "error": None, "checked": "count"}


@pytest.fixture(scope="module")
def parts() -> list[dict[int, list[int]]]:
    """A correct engine's tokens, split by the rank the skewed controller gives each."""
    outs = served_tokens(SPEC, 1024, 8)
    wl = make_workload(SPEC, CONFIG.vocab_size)
    ctrl = DPController(SIZE, *dp_bench.LOADS["skewed"])
    out: list[dict[int, list[int]]] = [{} for _ in range(SIZE)]
    for i, w in enumerate(wl):
        out[ctrl.assign(len(w.prompt), w.max_new_tokens)][i] = list(outs[i])
    return out


def _check(parts):
    return dp_bench._verify_reference(CONFIG, torch.float32, CPU, 2, 8, SPEC, parts, VERIFIED)


def test_correct_tokens_of_every_rank_are_verified(parts):
    v = _check(parts)
    assert v["status"] == "verified", v
    assert v["reference_probes"] == 2 * sum(min(len(p), REQUESTS) for p in parts)


def test_wrong_tokens_on_a_rank_outside_the_first_requests_fail(parts):
    assert parts[3] and min(parts[3]) >= REQUESTS  # the gap: none of rank 3's was probed
    bad = [dict(p) for p in parts]
    bad[3] = {i: [(t + 1) % CONFIG.vocab_size for t in o] for i, o in parts[3].items()}
    v = _check(bad)
    assert v["status"] == "failed" and "rank 3" in v["error"], v
