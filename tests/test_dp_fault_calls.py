"""Calls that one rank makes while its peer steps (gloo, 2 CPU processes): a DPEngine built,
or ``shutdown()``. Neither is a gloo collective now (the store carries them), so each rank
raises within the timeout naming what happened, instead of gloo aborting a process (the
set-up check was a host all-gather of another size than the step agreement it met: "Received
data size doesn't match expected size", SIGABRT). They then refuse their later calls without
a collective and leave at ``shutdown()`` at once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from dp_control_world import _sharded_runner, timed

from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.dp.launch import spawn
from lora_runtime.engine.scheduler import SchedulerConfig

TIMEOUT_S = 3.0
CPU = torch.device("cpu")
CFG = SchedulerConfig(max_batch_size=4, max_step_tokens=16)



def diverging_rank(rank: int, call: str, out_dir: str) -> None:
    """Rank 0 makes ``call`` (build a DPEngine, or shut down) while rank 1 steps."""
    dp = init_dp(CPU)
    eng = DPEngine(_sharded_runner(dp), dp, CFG)
    eng.generate([[1, 2, 3]], [None], 2)  # in step
    log: dict = {}
    if rank == 0:
        fn = (lambda: DPEngine(eng.runner, dp, CFG)) if call == "build" else (
            lambda: shutdown(CPU))
    timed(log, "diverging call", fn if rank == 0 else eng.step)
    timed(log, "step after", eng.step)
    if call == "shutdown" and rank == 1:
        # Rank 0 waits for this rank to reach shutdown() until the timeout, as this rank
        # waits in its agreement: a shutdown of its at once could just make rank 0's check
        # after the timeout (then rank 0 rightly leaves, every rank having come).
        time.sleep(TIMEOUT_S)
    timed(log, "shutdown", lambda: shutdown(CPU))
    torch.save(log, Path(out_dir, f"calls{rank}.pt"))
    # Hazard: a process whose gloo collective failed may abort while exiting, as its pairs
    # are torn down ("terminate called without an active exception"; tests/test_dp_group.py).
    os._exit(0)


def _diverge(tmp_path, call: str) -> tuple[dict, dict]:
    t0 = time.monotonic()
    spawn(diverging_rank, 2, call, str(tmp_path), timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"took {elapsed:.0f} s"
    first, second = (torch.load(tmp_path / f"calls{r}.pt") for r in range(2))
    said = second["diverging call"]
    assert said.startswith("RuntimeError") and "step agreement all-gather failed" in said, said
    assert "restart every rank" in said
    for log in (first, second):
        assert log["diverging call s"] < 4 * TIMEOUT_S
    assert "restart every rank" in second["step after"], second["step after"]
    assert second["step after s"] < 1.0
    assert second["shutdown"] == "ok", second["shutdown"]
    assert second["shutdown s"] < 1.0
    return first, second


def test_an_engine_built_on_one_rank_while_the_other_steps_raises_on_both(tmp_path):
    first, _ = _diverge(tmp_path, "build")
    said = first["diverging call"]
    assert said.startswith("RuntimeError") and "DPEngine set-up check" in said, said
    assert "ranks [1] did not reach it" in said and "restart every rank" in said, said
    assert "restart every rank" in first["step after"], first["step after"]
    assert first["step after s"] < 1.0
    assert first["shutdown"] == "ok" and first["shutdown s"] < 1.0, first["shutdown"]


def test_a_shutdown_on_one_rank_while_the_other_steps_raises_on_both(tmp_path):
    first, _ = _diverge(tmp_path, "shutdown")
    said = first["diverging call"]
    assert said.startswith("RuntimeError"), said
    assert "shutdown waited 3 s for ranks [1] to reach shutdown()" in said, said
    assert "was shut down" in first["step after"], first["step after"]
    assert first["shutdown"] == "ok"  # a second shutdown: nothing left to leave
