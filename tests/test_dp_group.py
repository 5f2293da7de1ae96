"""The DP group's collective timeout and ``spawn``'s arguments: values that are not a finite
number of seconds > 0, or a size that is not an integer, are refused naming the input, before
any process group or process starts."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-3", ""])
def test_a_bad_dp_timeout_s_is_refused_naming_it(rank_env, value):
    rank_env.setenv("DP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="DP_TIMEOUT_S"):
        init_dp(torch.device("cpu"))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "5"])
def test_a_bad_timeout_argument_is_refused_naming_it(rank_env, value):
    with pytest.raises(ValueError, match="timeout_s"):
        init_dp(torch.device("cpu"), timeout_s=value)


@pytest.mark.parametrize("kwargs, says", [
    (dict(size=2.0), "integer"), (dict(size=0), ">= 1"), (dict(size=True), "integer"),
    (dict(size=1, timeout_s=0), "timeout_s"), (dict(size=1, timeout_s=float("inf")), "timeout_s"),
])
def test_spawn_refuses_bad_arguments_before_starting(kwargs, says):
    with pytest.raises(ValueError, match=says):
        spawn(print, **kwargs)
