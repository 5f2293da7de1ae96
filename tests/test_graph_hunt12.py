"""Graph capture and replay against a twelfth hunt (CPU stand-in; 2-rank gloo spawns for DP).

- Under DP attention a replay whose step gathers rows of the other mode (``gathered.mode``
  EXTEND on a decode runner: a step mixing modes, which runs eagerly; an idle rank handed
  the other runner) planned the step's LoRA batch, moving adapters into slots, and then
  failed in the static layout's check with "plan has block_m=64, layout needs 16", naming
  neither the batch nor the fix. It is refused before any state changes, naming both modes.
- A ``GraphRunner`` read ``runner.dp`` once: built before ``shard_mlp`` (as ``ModelRunner``
  may be), it captured the sharded model as unsharded and its capture failed inside the MLP
  ("'NoneType' object has no attribute 'rows_per_rank'").
- A capture that failed part-way kept the failed attempt's capture times in ``stats``.
- ``run_beside`` joined the side stream only when both branches returned: one that raised
  inside a CUDA capture left the fork unjoined, so the capture's end raised CUDA's "unjoined"
  error in place of the branch's own, and left the capture's stream current (``torch.cuda.graph``
  restores it after ``capture_end``).
No replay with stale metadata was found: random loads, unloads, same-name replacements, pins,
idle replays (base and lora variants), larger agreed buckets and refused replays between
steps matched eager forwards on the torch and Triton backends.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from runtime_helpers import ALL_TARGETS, make_runtime

from graphs import GraphRunner
from lora_runtime.dp.launch import spawn
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode, GatheredRows
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny

DECODE, EXTEND = ForwardMode.DECODE, ForwardMode.EXTEND


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item() if want.numel() else 0.0


def _sharded_runtime(lora_slots: int):
    """This rank's tiny model with its MLP sharded over the spawned group and a torch-backend
    LoRA manager of ``lora_slots`` slots."""
    from lora_runtime.dp.group import init_dp
    from lora_runtime.dp.shard import shard_mlp
    from lora_runtime.engine.kv_cache import KVCache
    from lora_runtime.engine.model_runner import ModelRunner
    from lora_runtime.lora.lora_config import LoRAConfig
    from lora_runtime.lora.manager import LoRAManager
    from lora_runtime.model.llama import LlamaForCausalLM

    cfg = tiny(1)
    dp = init_dp(torch.device("cpu"))
    model = LlamaForCausalLM.random(cfg, torch.float32, "cpu", seed=0)
    shard_mlp(model, dp)
    lora = LoRAManager(model, LoRAConfig(lora_slots, 8, ALL_TARGETS, "torch"))
    return cfg, ModelRunner(model, KVCache(cfg, 200, torch.float32, "cpu"), lora)


def _other_mode_rank(rank: int, out_dir: str) -> None:
    from lora_runtime.dp.group import shutdown

    cfg, runner = _sharded_runtime(lora_slots=1)
    lora = runner.lora
    for i, name in enumerate("ab"):
        lora.load_adapter(name, random_adapter(cfg, name, 8, ALL_TARGETS, seed=5 + i,
                                               b_std=0.5))
    dec = GraphRunner.decode(runner, [2], 16).capture()
    pre = GraphRunner.prefill(runner, [4], 2).capture()
    # The step before: rank 0 prefills a request on "a" (slot 0), rank 1 is idle.
    req = Request([1, 2, 3], "a", 8)
    prefill = GatheredRows(EXTEND, 3, (("a",), ()), ((3,), ()))
    if rank == 0:
        first = dataclasses.replace(build_extend([req], runner.kv, "cpu"), gathered=prefill)
    else:
        first = ForwardBatch.idle(lora, "cpu", prefill)
    logits = runner.forward_eager(first)
    if rank == 0:
        req.output.append(int(logits[0].argmax()))
        own = dataclasses.replace(build_decode([req], runner.kv, "cpu"), adapter_names=("b",))
    else:
        own = ForwardBatch.idle(lora, "cpu")
    log = {"slots": list(lora.pool.owner)}
    names = (("b",), ())
    # Rank 0's decode step gathered as EXTEND (a step that mixes modes) on the decode runner,
    # and an idle rank handed the prefill runner in a decode step: both refused, nothing moved.
    for what, g, mode, rows in (("decode runner", dec, EXTEND, 2),
                                ("prefill runner", pre, DECODE, 4)):
        if what == "prefill runner" and rank == 0:
            continue  # rank 0's decode batch has no prefill bucket at all
        bad = dataclasses.replace(own, gathered=GatheredRows(mode, rows, names, ((1,), ())))
        try:
            g.replay(bad, rows)
            log[what] = "accepted"
        except ValueError as e:
            log[what] = str(e)
        log[f"{what} slots"] = list(lora.pool.owner)
    # The step as agreed (DECODE rows) replays as its eager forward does.
    agreed = dataclasses.replace(own, gathered=GatheredRows(DECODE, 2, names, ((1,), ())))
    eager = runner.forward_eager(agreed).clone()
    log["err"] = _max_err(dec.replay(agreed, 2), eager)
    torch.save(log, Path(out_dir, f"rank{rank}.pt"))
    shutdown(torch.device("cpu"))


def test_a_dp_replay_of_the_other_modes_step_is_refused_before_any_slot_moves(tmp_path):
    spawn(_other_mode_rank, 2, str(tmp_path), timeout_s=60)
    for rank in range(2):
        log = torch.load(tmp_path / f"rank{rank}.pt")
        assert log["slots"] == ["a"], log
        checked = ["decode runner"] + (["prefill runner"] if rank == 1 else [])
        for what in checked:
            assert log[what] != "accepted", (rank, what)
            mode, other = ("extend", "decode") if what == "decode runner" else ("decode",
                                                                                 "extend")
            assert f"gathered.mode is {mode}" in log[what], (rank, log[what])
            assert f"a {other} graph runner" in log[what], (rank, log[what])
            assert log[f"{what} slots"] == ["a"], (rank, what, log)
        assert log["err"] < 1e-5, (rank, log)


def _built_before_shard_rank(rank: int, out_dir: str) -> None:
    from lora_runtime.dp.group import init_dp, shutdown
    from lora_runtime.dp.shard import shard_mlp
    from lora_runtime.engine.kv_cache import KVCache
    from lora_runtime.engine.model_runner import ModelRunner
    from lora_runtime.model.llama import LlamaForCausalLM

    cfg = tiny(1)
    dp = init_dp(torch.device("cpu"))
    model = LlamaForCausalLM.random(cfg, torch.float32, "cpu", seed=0)
    runner = ModelRunner(model, KVCache(cfg, 200, torch.float32, "cpu"), None)
    g = GraphRunner.decode(runner, [1], 16)
    shard_mlp(model, dp)
    log = {}
    try:
        g.capture()
        req = Request([1 + rank, 2, 3], None, 8)
        pre = dataclasses.replace(build_extend([req], runner.kv, "cpu"), gathered=GatheredRows(
            EXTEND, 3, ((None,), (None,)), ((3,), (3,))))
        req.output.append(int(runner.forward_eager(pre)[0].argmax()))
        step = dataclasses.replace(build_decode([req], runner.kv, "cpu"), gathered=GatheredRows(
            DECODE, 1, ((None,), (None,)), ((1,), (1,))))
        eager = runner.forward_eager(step).clone()
        log["err"] = _max_err(g.replay(step, 1), eager)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        log["error"] = f"{type(e).__name__}: {e}"
    torch.save(log, Path(out_dir, f"rank{rank}.pt"))
    shutdown(torch.device("cpu"))


def test_a_graph_runner_built_before_shard_mlp_captures_the_sharded_mlp(tmp_path):
    spawn(_built_before_shard_rank, 2, str(tmp_path), timeout_s=60)
    for rank in range(2):
        log = torch.load(tmp_path / f"rank{rank}.pt")
        assert "error" not in log, (rank, log)
        assert log["err"] < 1e-5, (rank, log)


def test_a_failed_capture_leaves_no_stats_of_the_graphs_it_dropped(monkeypatch):
    """A capture that failed part-way dropped its graphs but kept their capture times:
    ``stats.total_capture_seconds`` described graphs the runner no longer had."""
    import graphs.runner as runner_module

    cfg = tiny(1)
    rt = make_runtime(cfg, dtype=torch.float32, device=torch.device("cpu"), slots=2,
                      max_rank=4, kv_tokens=64)
    rt.lora.load_adapter("a", random_adapter(cfg, "a", 4, ALL_TARGETS, seed=1, b_std=0.3))
    real, calls = runner_module.capture, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("capture failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "capture", failing_third)
    g = GraphRunner.decode(rt, [1, 2], 8)
    with pytest.raises(RuntimeError, match="capture failed"):
        g.capture()
    assert not g.captured and rt.lora.backend.batch_info is None
    assert g.stats.capture_seconds == {} and g.stats.total_capture_seconds == 0
    g.capture()  # the next capture serves
    assert sorted(g.stats.capture_seconds) == ["base/1", "base/2", "lora/1", "lora/2"]
    req = Request([1, 2, 3], "a", 4)
    rt.forward_eager(build_extend([req], rt.kv, "cpu"))
    req.output.append(5)
    step = build_decode([req], rt.kv, "cpu")
    eager = rt.forward_eager(step).clone()
    assert _max_err(g.replay(step), eager) < 1e-5 and g.last_kind == "lora"


class _Stream:
    """A stand-in CUDA stream that records which streams it waited for."""

    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_stream(self, other: _Stream) -> None:
        self.waited.append(other.name)


@pytest.mark.parametrize("raising", ["side", "main"])
def test_a_branch_that_raises_inside_a_capture_still_joins_the_fork(monkeypatch, raising):
    """``run_beside`` forked the side stream and joined it only after both branches
    returned: one that raised inside a capture left the fork unjoined, so the capture's end
    failed with CUDA's "unjoined" error in place of the branch's own (and, raising there,
    left the capture's stream current)."""
    import contextlib

    from lora_runtime.lora import side_stream

    current, branch = _Stream("current"), _Stream("branch")
    monkeypatch.setattr(side_stream, "forking", lambda x: True)
    monkeypatch.setattr(side_stream, "_side_stream", lambda device: branch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def work(name: str):
        def run():
            if name == raising:
                raise ValueError(f"{name} failed")
            return name

        return run

    with pytest.raises(ValueError, match=f"{raising} failed"):
        side_stream.run_beside(work("side"), work("main"), torch.zeros(1))
    assert branch.waited == ["current"] and current.waited == ["branch"]
    raising = None
    assert side_stream.run_beside(work("side"), work("main"), torch.zeros(1)) == ("side",
                                                                                 "main")
