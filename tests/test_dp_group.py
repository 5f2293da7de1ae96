"""The DP group's collective timeout and ``spawn``'s arguments: values that are not a finite
number of seconds > 0, or a size that is not an integer, are refused naming the input, before
any process group or process starts; a group the caller made keeps its own timeout, the DP
collectives run under theirs."""

from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lora_runtime.dp.group import init_dp
from lora_runtime.dp.launch import free_port, spawn


@pytest.fixture
def rank_env(monkeypatch):
    """Rank 1 of 2 with nobody at the master's port: an init that got past the checks fails
    on its own (or waits out its timeout), never joins a group."""
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DP_TIMEOUT_S", raising=False)
    return monkeypatch


# 1e-9 and 0.0004 s are 0 ms to torch: the first connection timed out at once; 1e20 and 1e300
# raised OverflowError from timedelta or torch, naming neither.
@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-3", "", "1e-9", "0.0004", "1e20",
                                   "1e300"])
def test_a_bad_dp_timeout_s_is_refused_naming_it(rank_env, value):
    rank_env.setenv("DP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="DP_TIMEOUT_S"):
        init_dp(torch.device("cpu"))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "5", 1e-9, 1e300])
def test_a_bad_timeout_argument_is_refused_naming_it(rank_env, value):
    with pytest.raises(ValueError, match="timeout_s"):
        init_dp(torch.device("cpu"), timeout_s=value)


@pytest.mark.parametrize("kwargs, says", [
    (dict(size=2.0), "integer"), (dict(size=0), ">= 1"), (dict(size=True), "integer"),
    (dict(size=1, timeout_s=0), "timeout_s"), (dict(size=1, timeout_s=float("inf")), "timeout_s"),
    (dict(size=1, timeout_s=1e-4), "timeout_s"), (dict(size=1, timeout_s=1e12), "timeout_s"),
])
def test_spawn_refuses_bad_arguments_before_starting(kwargs, says):
    with pytest.raises(ValueError, match=says):
        spawn(print, **kwargs)


def _caller_made_the_group(rank: int) -> None:
    """Rank 0 enters a DP collective that rank 1 never joins: it must fail within the DP
    timeout (2 s, from ``spawn``), not the caller's group's 60 s. Both ranks leave by
    ``os._exit``: tearing down gloo pairs after a timed-out collective aborts the process."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dp = init_dp(torch.device("cpu"))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["rank0_done"], datetime.timedelta(seconds=120))
        store.set("rank1_done", "1")
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=dp.cpu_group)
        fault = "a collective that rank 1 never joined returned"
    except RuntimeError:
        waited = time.monotonic() - t0
        fault = f"the DP collective waited {waited:.0f} s: the caller's timeout" if (
            waited > 30) else None
    store.set("rank0_done", "1")
    store.wait(["rank1_done"], datetime.timedelta(seconds=120))
    if fault:
        print(fault, file=sys.stderr, flush=True)
    os._exit(1 if fault else 0)


def test_a_group_the_caller_made_keeps_its_timeout_and_dp_uses_its_own():
    spawn(_caller_made_the_group, 2, timeout_s=2)


def _aborts_in_teardown(rank: int, out_dir: str) -> None:
    """Work done and written, then an abort in the interpreter's teardown, as gloo's threads
    did in CI after a clean shutdown: the rank must count as done."""
    import atexit
    atexit.register(os.abort)
    with open(os.path.join(out_dir, f"done{rank}"), "w") as f:
        f.write("ok")


def test_a_rank_whose_work_is_done_is_not_failed_by_the_interpreter_teardown(tmp_path):
    spawn(_aborts_in_teardown, 2, str(tmp_path), timeout_s=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done0", "done1"]


def _raises(rank: int) -> None:
    raise ValueError(f"rank {rank} refused its input")


def test_a_rank_that_raises_still_fails_spawn_naming_its_error():
    with pytest.raises(Exception, match="refused its input"):
        spawn(_raises, 2, timeout_s=10)


def _records_timeout(rank: int, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"t{rank}"), "w") as f:
        f.write(os.environ["DP_TIMEOUT_S"])


def test_spawn_lets_dp_timeout_s_win_and_refuses_a_bad_one(tmp_path, monkeypatch):
    """The variable wins over ``timeout_s`` (as in ``init_dp``): spawn had overwritten it in
    the ranks' environment, and a bad value went unchecked."""
    monkeypatch.setenv("DP_TIMEOUT_S", "5")
    spawn(_records_timeout, 1, str(tmp_path), timeout_s=30)
    assert (tmp_path / "t0").read_text() == "5.0"
    monkeypatch.setenv("DP_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match="DP_TIMEOUT_S='abc'"):
        spawn(_records_timeout, 1, str(tmp_path), timeout_s=30)
