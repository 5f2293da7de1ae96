"""A step that every rank refuses at its agreement (here: an adapter load that failed on one
rank, so the ranks' loaded adapters differ) leaves the ranks' requests queued as they were, and
once the load is redone serving goes on (gloo, 2 CPU processes, serial and overlapped).

Before, the requests that step's schedule had admitted stayed running although no agreement
named their adapters; the next step's slot quotas (rotated) let the other rank admit as many
new adapters again, and the union (4 adapters for 3 slots) failed every rank's forward with
SlotPoolError mid-step: every rank faulted ("restart every rank")."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from dp_control_world import _sharded_runner
from dp_world import CONFIG, MAX_RANK, adapters, spawned_logs
from engine_world import compare_with_alone, run_alone
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
# Each rank's requests on adapters of its own: 4 adapters for the 3 slots (dp_world.SLOTS).
SPECS = {0: [([1, 2, 3], "ad0"), ([4, 5, 6], "ad1")], 1: [([7, 8], "ad2"), ([9, 1, 4], "ad3")]}
TOKENS = 4


def refused_rank(rank: int, overlap: bool, out_dir: str) -> None:
    log: dict = {}
    try:
        dp = init_dp(CPU)
        eng = DPEngine(_sharded_runner(dp), dp, SchedulerConfig(max_batch_size=4,
                                                                max_step_tokens=16),
                       keep_logits=True, overlap=overlap)
        ads = adapters()
        for ad in ads:
            eng.load_adapter(ad.name, ad)
        reqs = [eng.add_request(p, a, max_new_tokens=TOKENS) for p, a in SPECS[rank]]
        try:  # rank 1's source is missing: loaded on rank 0 only
            eng.load_adapter("extra", ads[0] if rank == 0 else "/nonexistent/adapter")
        except Exception as e:  # noqa: BLE001 (the failed load this test is about)
            log["load"] = f"{type(e).__name__}: {e}"
        try:
            eng.step()
            log["step"] = "ok"
        except RuntimeError as e:
            log["step"] = str(e)
        log["queued"] = (len(eng.scheduler.waiting), len(eng.scheduler.running))
        if rank == 1:
            eng.load_adapter("extra", ads[0])  # the fix: the same adapters on every rank
        try:
            eng.run()
            log["run"] = "ok"
        except RuntimeError as e:
            log["run"] = str(e)
        log["outputs"] = [(a, p, list(r.output), [t.clone() for t in eng.logits.get(r.id, [])])
                          for (p, a), r in zip(SPECS[rank], reqs, strict=True)]
        log["free"] = (eng.kv.free_slots, eng.kv.max_tokens)
        shutdown(CPU)
    except BaseException:  # noqa: BLE001 (recorded for the test to judge)
        log["error"] = traceback.format_exc()
    torch.save(log, Path(out_dir, f"refused{rank}.pt"))
    os._exit(0)  # as tests/test_dp_fault_calls.py: a failed gloo pair may abort at exit


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_step_refused_on_every_rank_leaves_requests_queued_and_serving_goes_on(tmp_path,
                                                                                 overlap):
    logs = spawned_logs(refused_rank, tmp_path, "refused", overlap)
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    by_name = {a.name: a for a in adapters()}
    assert "load" in logs[1] and "load" not in logs[0], (logs[0].get("load"), logs[1])
    for rank, log in enumerate(logs):
        assert "error" not in log, f"rank {rank}: {log['error']}"
        assert "loaded adapters, their weights or pins differ" in log["step"], log["step"]
        assert log["run"] == "ok", f"rank {rank}: {log['run']}"
        assert log["queued"] == (2, 0), f"rank {rank}: the refused step admitted requests"
        assert log["free"][0] == log["free"][1]
        for adapter, prompt, output, logits in log["outputs"]:
            assert len(output) == TOKENS, (rank, adapter, output)
            want = run_alone(ref, by_name, prompt, adapter, output)
            compare_with_alone(logits, want, output, torch.float32, f"rank {rank} {adapter}")
