"""Data-parallel attention on gloo (CPU processes): every request's logits at every sampled
token equal the DP=1 reference (the request run alone on an unsharded model), with idle
ranks, steps where one rank has tokens, steps where no rank has an adapter, eagerly and with
graphs (the traced stand-in carries the collectives); a dead rank stops the others with an
error in bounded time."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from dp_world import CONFIG, MAX_RANK, adapters, serve_rank, workload
from engine_world import compare_with_alone, run_alone
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.launch import spawn


@pytest.fixture(scope="module")
def reference():
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    return ref, {a.name: a for a in adapters()}


def _serve(size: int, opts: dict, tmp_path, timeout_s: float = 60.0) -> list[dict]:
    spawn(serve_rank, size, size, opts, str(tmp_path), timeout_s=timeout_s)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]


def _check(results, opts, reference) -> dict:
    ref, by_name = reference
    wl = workload(opts.get("seed", 0), opts["n"])
    seen, compared = set(), 0
    for res in results:
        for i, (output, logits) in res["requests"].items():
            prompt, adapter, new = wl[i]
            assert len(output) == new
            want = run_alone(ref, by_name, prompt, adapter, output)
            compared += compare_with_alone(logits, want, output, torch.float32,
                                           f"request {i} ({adapter})")
            seen.add(i)
    assert seen == set(range(len(wl))), "every request is served by exactly one rank"
    return {"compared": compared,
            "idle_steps": [r["modes"].count("idle") for r in results],
            "graph_steps": [r["graph_steps"] for r in results],
            "base_variant_steps": [r["variants"].count("base") for r in results]}


@pytest.mark.parametrize("size,policy,graphs", [
    (1, "round_robin", False), (2, "skewed", False), (2, "least_loaded", True),
    (4, "skewed", False), (4, "round_robin", True),
])
def test_dp_logits_equal_the_dp1_reference(size, policy, graphs, tmp_path, reference, capsys):
    opts = {"n": 10, "policy": policy, "share": 0.7, "graphs": graphs, "seed": size}
    stats = _check(_serve(size, opts, tmp_path), opts, reference)
    with capsys.disabled():
        print(f"\n[dp] size={size} policy={policy} graphs={graphs} {stats}")
    if size > 1:
        assert sum(stats["idle_steps"]) > 0, "the workload must make some rank idle"
    if graphs:
        assert all(g > 0 for g in stats["graph_steps"]), "every rank must replay graphs"


def test_a_dead_rank_stops_the_others_with_an_error(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(mp.ProcessRaisedException) as e:  # noqa: PT012
        try:
            _serve(2, {"n": 6, "die_rank": 1}, tmp_path, timeout_s=10.0)
        except mp.ProcessExitedException as exited:
            assert exited.exit_code == 3
            raise mp.ProcessRaisedException("rank 1 died", 1, 0) from exited
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"the ranks took {elapsed:.0f}s to stop"
    assert "rank 1 died" in str(e.value) or "Error" in str(e.value)
