"""DP control path on gloo: the ranks load the same adapters in different orders and still
serve each request as a single engine does; a pin or an unload that one rank's requests
forbid is refused on every rank; ``generate`` returns on every rank; a request that can
never be admitted raises on every rank instead of idling forever. With overlap, ranks whose
requests allow different run-aheads stay in step for a control call between two steps, and
engines built differently on the ranks are refused on every rank."""

from __future__ import annotations

import pytest
import torch
from dp_control_world import (
    PROMPTS,
    control_rank,
    diverging_rank,
    fault_rank,
    overlap_control_rank,
)
from dp_world import CONFIG, MAX_RANK, adapters
from engine_world import compare_with_alone, run_alone
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.launch import spawn


def _spawned_logs(tmp_path_factory, scenario, tag: str) -> list[dict]:
    out = tmp_path_factory.mktemp(f"dp_{tag}")
    spawn(scenario, 2, 2, str(out), timeout_s=60.0)
    return [torch.load(out / f"{tag}{r}.pt") for r in range(2)]


def _check_alone(log: dict, tokens: int) -> None:
    """Each request of ``log["outputs"]`` has ``tokens`` tokens and the logits it has alone."""
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    by_name = {a.name: a for a in adapters()}
    for name, (output, logits) in log["outputs"].items():
        assert len(output) == tokens
        want = run_alone(ref, by_name, PROMPTS[name], name, output)
        compare_with_alone(logits, want, output, torch.float32, f"request on {name}")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return _spawned_logs(tmp_path_factory, control_rank, "control")


def test_loading_order_does_not_change_what_a_request_computes(logs):
    for log in logs:
        _check_alone(log, 6)


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


@pytest.fixture(scope="module")
def overlap_logs(tmp_path_factory):
    return _spawned_logs(tmp_path_factory, overlap_control_rank, "overlap")


def test_ranks_run_ahead_together_so_control_calls_pair_up(overlap_logs):
    for log, n in zip(overlap_logs, (6, 1), strict=True):
        _check_alone(log, n)
    assert [len(log["tight"][0]) for log in overlap_logs] == [6, 3]
    assert overlap_logs[0]["ahead"] == overlap_logs[1]["ahead"]
    assert any(overlap_logs[0]["ahead"]), "rank 0's decode steps must run ahead"


def test_a_request_waiting_for_a_slot_outlasts_no_other_ranks_stream(overlap_logs):
    """Past ``max_overtake_steps`` the other ranks admit no request with an adapter until it
    has a slot, as a single engine stops admitting: rank 1's request is served before the
    last of rank 0's ten."""
    first, second = overlap_logs
    assert [len(out) for out in first["fair"]] == [3] * 10 and len(second["fair"][0]) == 3
    assert second["fair last served"] < first["fair last served"] - 3, (
        second["fair last served"], first["fair last served"])


def test_engines_built_differently_are_refused_on_every_rank(overlap_logs):
    for log in overlap_logs:
        assert "max_batch_size" in log["mismatch"] and "[4, 5]" in log["mismatch"]
        assert log["hooks kept"] == [True, True]
        assert "shard_mlp" in log["unsharded"]


@pytest.fixture(scope="module")
def diverging_logs(tmp_path_factory):
    return _spawned_logs(tmp_path_factory, diverging_rank, "diverging")


def test_one_name_with_other_weights_is_refused_on_every_rank(diverging_logs):
    for log in diverging_logs:
        said = log["same name, other weights"]
        assert said.startswith("RuntimeError") and "from the same weights" in said
        _check_alone(log, 6)  # served once the rank loaded the right weights
        assert "from the same weights" in log["ahead"], log["ahead"]
        _check_alone({"outputs": log["ahead outputs"]}, 6)  # the step in flight was kept


def test_a_call_refused_on_one_rank_leaves_the_ranks_in_step(diverging_logs):
    first, second = diverging_logs
    assert len(first["bad generate"][0]) == 4
    assert second["bad generate"].startswith("ValueError")
    assert [len(log["next generate"][0]) for log in diverging_logs] == [2, 3]
    assert "has requests" in first["warm_up"]
    assert "refused on ranks [0]" in second["warm_up"]
    for log in diverging_logs:
        said = log["diverging call"]
        assert "rank 0 in unload_adapter, rank 1 in step agreement" in said, said
        assert len(log["after"][0]) == 3


@pytest.mark.parametrize("key, field", [("step tokens", "max_step_tokens"),
                                        ("chunked", "chunked_prefill"), ("graphs", "graphs"),
                                        ("kv", "kv_tokens")])
def test_every_setting_that_shapes_the_steps_must_match(diverging_logs, key, field):
    for log in diverging_logs:
        assert log[key].startswith("ValueError") and f"'{field}'" in log[key], log[key]


@pytest.fixture(scope="module")
def fault_logs(tmp_path_factory):
    return _spawned_logs(tmp_path_factory, fault_rank, "fault")


def test_graphs_none_captured_leave_the_steps_eager(fault_logs):
    """As in a single engine (a capture that failed leaves no graph): they replayed, and
    every step raised that no graph was captured."""
    for log in fault_logs:
        assert len(log["uncaptured"][0]) == 3, log["uncaptured"]
        _check_alone({"outputs": log["uncaptured outputs"]}, 3)


def test_a_pin_on_one_rank_is_refused_on_every_rank_before_the_forward(fault_logs):
    for log in fault_logs:
        said = log["one rank pins"]
        assert said.startswith("RuntimeError") and "weights or pins differ" in said, said
        _check_alone(log, 3)


def test_a_forward_that_raised_on_one_rank_stops_its_later_calls(fault_logs):
    first, second = fault_logs
    assert first["fault"].startswith("RuntimeError: dp rank 0/2: the step's forward raised")
    assert "(RuntimeError: injected fault)" in first["fault"]
    assert "restart every rank" in first["fault"]
    assert second["fault"].startswith("RuntimeError")  # gloo: the peer closed the connection
    for log in fault_logs:
        for key in ("step after", "unload after"):
            said = log[key]
            assert "a forward raised on this rank mid-step" in said, said
            assert "restart every rank" in said
