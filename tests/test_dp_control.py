"""DP control path on gloo: the ranks load the same adapters in different orders and still
serve each request as a single engine does; a pin or an unload that one rank's requests
forbid is refused on every rank; ``generate`` returns on every rank; a request that can
never be admitted raises on every rank instead of idling forever."""

from __future__ import annotations

import pytest
import torch
from dp_control_world import PROMPTS, control_rank
from dp_world import CONFIG, MAX_RANK, adapters
from engine_world import compare_with_alone, run_alone
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.launch import spawn


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_control")
    spawn(control_rank, 2, 2, str(out), timeout_s=60.0)
    return [torch.load(out / f"control{r}.pt") for r in range(2)]


def test_loading_order_does_not_change_what_a_request_computes(logs):
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    by_name = {a.name: a for a in adapters()}
    for log in logs:
        for name, (output, logits) in log["outputs"].items():
            assert len(output) == 6
            want = run_alone(ref, by_name, PROMPTS[name], name, output)
            compare_with_alone(logits, want, output, torch.float32, f"request on {name}")


def test_pin_and_unload_are_refused_on_every_rank(logs):
    for log in logs:
        assert log["pin ad3"].startswith("ValueError") and "for 3 slots" in log["pin ad3"]
        assert log["unload ad0"].startswith("ValueError") and "ranks [0]" in log["unload ad0"]


def test_generate_returns_on_every_rank(logs):
    assert [len(log["generate"][0]) for log in logs] == [2, 5]


def test_a_request_that_can_never_be_admitted_raises_on_every_rank(logs):
    for log in logs:
        assert log["stuck"].startswith("RuntimeError") and "ranks [0]" in log["stuck"]
    assert "'ad3'" in logs[0]["stuck"] and "can never be admitted" in logs[0]["stuck"]
    assert logs[0]["stuck steps"] == logs[1]["stuck steps"]
