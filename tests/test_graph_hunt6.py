"""Graph replays against a seventh hunt: under DP attention a replay left to pick its variant
followed this rank's own rows, so a rank whose rows were base-only replayed "base" and its
shard of the MLP dropped its peers' LoRA (their logits wrong, silently); an explicit "base"
under peers' adapter rows is refused. A batch whose ids or positions are floats is refused
before any LoRA state (the static copies truncated 3.6 to 3 where eager refused it); int32
indices serve as int64 do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from runtime_helpers import ALL_TARGETS, make_runtime

from graphs import GraphRunner
from lora_runtime.dp.launch import spawn
from lora_runtime.engine.forward_batch import ForwardMode, GatheredRows
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny

MLP = ["gate_proj", "up_proj", "down_proj"]


def _default_variant_rank(rank: int, out_dir: str) -> None:
    """Rank 0's request on adapter "a" (MLP only), rank 1's on the base model."""
    from lora_runtime.dp.group import init_dp, shutdown
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
    lora = LoRAManager(model, LoRAConfig(2, 8, ALL_TARGETS, "torch"))
    runner = ModelRunner(model, KVCache(cfg, 200, torch.float32, "cpu"), lora)
    lora.load_adapter("a", random_adapter(cfg, "a", 8, MLP, seed=5, b_std=0.5))
    g = GraphRunner.decode(runner, [2], 16).capture()
    req = Request([1 + rank, 2, 3], "a" if rank == 0 else None, 8)
    names = (("a",), (None,))
    pre = dataclasses.replace(build_extend([req], runner.kv, "cpu"), gathered=GatheredRows(
        ForwardMode.EXTEND, 3, names, ((3,), (3,))))
    req.output.append(int(runner.forward_eager(pre)[0].argmax()))
    dec = dataclasses.replace(build_decode([req], runner.kv, "cpu"), gathered=GatheredRows(
        ForwardMode.DECODE, 2, names, ((1,), (1,))))
    eager = runner.forward_eager(dec).clone()
    log = {"err": (g.replay(dec, 2).clone() - eager).abs().max().item(), "kind": g.last_kind}
    try:
        g.replay(dec, 2, "base")
        log["base"] = "ok"
    except ValueError as e:
        log["base"] = str(e)
    # The refused replay changed nothing: the default one still matches.
    log["after"] = (g.replay(dec, 2).clone() - eager).abs().max().item()
    torch.save(log, Path(out_dir, f"rank{rank}.pt"))
    shutdown(torch.device("cpu"))


def test_a_dp_replay_left_to_pick_its_variant_keeps_its_peers_lora(tmp_path):
    spawn(_default_variant_rank, 2, str(tmp_path), timeout_s=60)
    logs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [log["kind"] for log in logs] == ["lora", "peers"]
    for log in logs:
        assert log["err"] < 1e-5 and log["after"] < 1e-5, log
    assert "this batch's adapter rows" in logs[0]["base"]
    assert "peers' adapter rows" in logs[1]["base"]


@pytest.fixture(scope="module")
def world():
    rt = make_runtime(tiny(1), dtype=torch.float32, device=torch.device("cpu"), slots=2,
                      max_rank=8, kv_tokens=256)
    rt.lora.load_adapter("a", random_adapter(rt.model.config, "a", 4, ALL_TARGETS, seed=1,
                                             b_std=0.3))
    return rt, GraphRunner.decode(rt, [1, 2], 32).capture(), GraphRunner.prefill(
        rt, [8, 16], 2, 16).capture()


def _batches(rt):
    req = Request([1, 2, 3], "a", 8)
    pre = build_extend([req], rt.kv, "cpu")
    rt.forward_eager(pre)
    req.output.append(5)
    return pre, build_decode([req], rt.kv, "cpu")


@pytest.mark.parametrize("field", ["input_ids", "positions", "out_cache_loc"])
def test_float_indices_are_refused_before_any_lora_state_and_int32_serves(world, field):
    rt, dec_graphs, pre_graphs = world
    pre, dec = _batches(rt)
    for g, b in ((dec_graphs, dec), (pre_graphs, pre)):
        want = g.replay(b).clone()
        version = rt.lora.pool.version
        bad = dataclasses.replace(b, **{field: getattr(b, field).float() + 0.6})
        with pytest.raises(ValueError, match=f"batch.{field} is torch.float32"):
            g.replay(bad)
        assert rt.lora.pool.version == version
        narrow = dataclasses.replace(b, **{field: getattr(b, field).int()})
        torch.testing.assert_close(g.replay(narrow), want, rtol=0, atol=0)
