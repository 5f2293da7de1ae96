"""Graph replays and data parallelism against a seventh hunt.

- ``shutdown`` then ``init_dp`` again in the same processes (the remedy that the refusal of a
  shut-down group names): a rank that re-joined at once while rank 0, which hosts the store,
  was still leaving met the old store (its old gloo addresses) and every rank failed on
  gloo's connect ("Connect timeout", "Connection reset by peer").
- ``shutdown`` in a world the caller made (``init_dp`` gave DP groups of their own there)
  destroyed the caller's world too: its next collective raised "Default process group has
  not been initialized".
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from dp_world import spawned_logs

from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.dp.shard import shard_mlp
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CPU = torch.device("cpu")


def _base_engine(dp) -> DPEngine:
    cfg = tiny(1)
    model = LlamaForCausalLM.random(cfg, torch.float32, "cpu", seed=0)
    shard_mlp(model, dp)
    runner = ModelRunner(model, KVCache(cfg, 32, torch.float32, "cpu"), None)
    return DPEngine(runner, dp, SchedulerConfig(max_batch_size=2, max_step_tokens=8))


def rejoin_rank(rank: int, out_dir: str) -> None:
    """Two worlds in a row; rank 0 joins the second one a second late, rank 1 at once."""
    log: dict = {}
    try:
        for world in range(2):
            dp = init_dp(CPU)
            log[world] = _base_engine(dp).generate([[1, 2, 3 + rank]], [None], 2)
            shutdown(CPU)
            if rank == 0:
                time.sleep(1.0)
    except BaseException:  # noqa: BLE001 (recorded for the test to judge)
        log["error"] = traceback.format_exc()[-1500:]
    torch.save(log, Path(out_dir, f"rejoin{rank}.pt"))
    os._exit(0)  # as tests/test_dp_fault_calls.py: a failed gloo pair may abort at exit


def test_init_dp_after_shutdown_joins_a_new_world(tmp_path):
    logs = spawned_logs(rejoin_rank, tmp_path, "rejoin")
    for rank, log in enumerate(logs):
        assert "error" not in log, f"rank {rank}: {log['error']}"
        assert log[0] == log[1] and len(log[1][0]) == 2, log


def callers_world_rank(rank: int, out_dir: str) -> None:
    log: dict = {}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
        dp = init_dp(CPU)
        log["served"] = _base_engine(dp).generate([[1, 2, 3 + rank]], [None], 2)
        shutdown(CPU)
        log["dp closed"] = dp.closed
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        log["callers all_reduce"] = t.item()
    except BaseException:  # noqa: BLE001 (recorded for the test to judge)
        log["error"] = traceback.format_exc()[-1500:]
    torch.save(log, Path(out_dir, f"caller{rank}.pt"))
    os._exit(0)


def test_shutdown_leaves_a_world_the_caller_made_to_the_caller(tmp_path):
    logs = spawned_logs(callers_world_rank, tmp_path, "caller")
    for rank, log in enumerate(logs):
        assert "error" not in log, f"rank {rank}: {log['error']}"
        assert log["dp closed"] and log["callers all_reduce"] == 3.0, log
