"""Data parallelism with idle ranks against a ninth hunt (gloo, 2 CPU processes, one world).

- A request no rank can admit (every slot pinned) raises on every rank after ``2 x DP size``
  idle steps, naming the fix (unpin an adapter). Once it was made, the next ``run()`` raised
  the same error again whenever the freed slot's turn (``_share_free_slots`` rotates it by
  agreed step) fell to a rank with nothing to admit: the count of idle steps went on from the
  first error instead of starting again. The rank with no request at all said "its own
  requests run".
- ``DPEngine(runner, SchedulerConfig(...))``, as ``Engine(runner, config)`` is written,
  raised "'SchedulerConfig' object has no attribute 'check_open'"; ``verify="no"`` raised
  "invalid literal for int()" and ``verify=0.5`` was compared as False by the set-up check
  but confirmed every step as True."""

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
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CPU = torch.device("cpu")
CFG = SchedulerConfig(max_batch_size=4, max_step_tokens=16)
STUCK_PROMPT, STUCK_TOKENS = [5, 5], 2


def _said(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
        return f"{type(e).__name__}: {e}"


def _stuck_then_fixed(dp, rank: int, extra_steps: int) -> dict:
    """ad0..ad2 pinned in the 3 slots, a request on ad3 on rank 0 alone: stuck; then ad0
    unpinned on every rank (the fix) and served. ``extra_steps`` idle steps first set which
    rank the freed slot's turn falls to."""
    log: dict = {}
    eng = DPEngine(_sharded_runner(dp), dp, CFG, keep_logits=True)
    for ad in adapters():
        eng.load_adapter(ad.name, ad, pinned=ad.name != "ad3")
    for _ in range(extra_steps):
        eng.step()
    req = eng.add_request(STUCK_PROMPT, "ad3", max_new_tokens=STUCK_TOKENS) if rank == 0 \
        else None
    log["stuck"] = _said(lambda: eng.run(max_steps=50))
    eng.pin_adapter("ad0", False)
    log["fixed"] = _said(eng.run)
    if req is not None:
        log["output"] = (list(req.output), [t.clone() for t in eng.logits.get(req.id, [])])
    return log


def _refused_settings(dp) -> dict:
    runner = _sharded_runner(dp)
    return {"verify=" + repr(v): _said(lambda v=v: DPEngine(runner, dp, CFG, verify=v))
            for v in ("no", 0.5, None)}


def hunt_rank(rank: int, out_dir: str) -> None:
    log: dict = {}
    try:
        dp = init_dp(CPU)
        for extra in (0, 1):
            log[f"stuck {extra}"] = _stuck_then_fixed(dp, rank, extra)
        log["settings"] = _refused_settings(dp)
        log["after"] = _said(lambda: DPEngine(_sharded_runner(dp), dp, CFG).generate(
            [[1, 2, 3 + rank]], [None], 2))
        shutdown(CPU)
    except BaseException:  # noqa: BLE001 (recorded for the test to judge)
        log["error"] = traceback.format_exc()
    torch.save(log, Path(out_dir, f"hunt{rank}.pt"))
    os._exit(0)  # as tests/test_dp_fault_calls.py: a failed gloo pair may abort at exit


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hunt9")
    logs = spawned_logs(hunt_rank, out, "hunt", timeout_s=30.0)
    for rank, log in enumerate(logs):
        assert "error" not in log, f"rank {rank}: {log['error']}"
    return logs


@pytest.mark.parametrize("extra", [0, 1])
def test_a_stuck_request_is_served_once_an_adapter_is_unpinned(logs, extra):
    for rank, log in enumerate(logs):
        case = log[f"stuck {extra}"]
        said = case["stuck"]
        assert said.startswith("RuntimeError") and "no rank ran a request" in said, said
        assert rank == 1 or "Unpin an adapter" in said, said
        assert case["fixed"] == "ok", f"rank {rank}, after the fix: {case['fixed']}"
    rank1 = logs[1][f"stuck {extra}"]["stuck"]
    assert "its own requests run" not in rank1 and "no request waiting" in rank1, rank1
    output, logits = logs[0][f"stuck {extra}"]["output"]
    assert len(output) == STUCK_TOKENS
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=64)
    want = run_alone(ref, {a.name: a for a in adapters()}, STUCK_PROMPT, "ad3", output)
    compare_with_alone(logits, want, output, torch.float32, "the request once unpinned")


def test_a_verify_flag_that_is_not_a_bool_is_refused_naming_it(logs):
    for rank, log in enumerate(logs):
        for key, said in log["settings"].items():
            assert said.startswith("TypeError") and "verify must be True or False" in said, \
                f"rank {rank} {key}: {said}"
        assert log["after"] == "ok", f"rank {rank}: the refusals left the ranks apart"


@pytest.mark.parametrize("dp", [SchedulerConfig(), None, "cpu"])
def test_a_dp_engine_given_no_dp_group_is_refused_naming_it(dp):
    cfg = tiny(1)
    model = LlamaForCausalLM.random(cfg, torch.float32, "cpu", seed=0)
    runner = ModelRunner(model, KVCache(cfg, 32, torch.float32, "cpu"), None)
    with pytest.raises(TypeError, match="DPEngine.*DPGroup.*init_dp"):
        DPEngine(runner, dp)
