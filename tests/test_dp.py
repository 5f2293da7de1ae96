"""Data-parallel attention on gloo (CPU processes): every request's logits at every sampled
token equal the DP=1 reference (the request run alone on an unsharded model), with idle
ranks, steps where one rank has tokens, steps where no rank has an adapter, eagerly and with
graphs (the traced stand-in carries the collectives); a dead rank stops the others with an
error in bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dp_world import CONFIG, MAX_RANK, adapters, serve_rank, workload
from engine_world import compare_with_alone, run_alone
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.launch import free_port, spawn

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference():
    ref = make_runtime(CONFIG, dtype=torch.float32, device="cpu", backend="torch", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    return ref, {a.name: a for a in adapters()}


def _gpu_reference():
    ref = make_runtime(CONFIG, dtype=torch.bfloat16, device="cuda", backend="triton", slots=1,
                       max_rank=MAX_RANK, targets=ALL_TARGETS, kv_tokens=256)
    return ref, {a.name: a.to(torch.bfloat16) for a in adapters()}


def _serve(size: int, opts: dict, tmp_path, timeout_s: float = 60.0) -> list[dict]:
    spawn(serve_rank, size, size, opts, str(tmp_path), timeout_s=timeout_s)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]


def _check(results, opts, reference, dtype=torch.float32) -> dict:
    ref, by_name = reference
    wl = workload(opts.get("seed", 0), opts["n"])
    seen, compared = set(), 0
    for res in results:
        for i, (output, logits) in res["requests"].items():
            prompt, adapter, new = wl[i]
            assert len(output) == new
            want = [w.float().cpu() for w in run_alone(ref, by_name, prompt, adapter, output)]
            compared += compare_with_alone(logits, want, output, dtype,
                                           f"request {i} ({adapter})")
            seen.add(i)
    assert seen == set(range(len(wl))), "every request is served by exactly one rank"
    return {"compared": compared,
            "idle_steps": [r["modes"].count("idle") for r in results],
            "graph_steps": [r["graph_steps"] for r in results],
            "graph_prefill_steps": [r["graph_prefill_steps"] for r in results],
            "base_variant_steps": [r["variants"].count("base") for r in results],
            "peers_variant_steps": [r["variants"].count("peers") for r in results],
            "warm_up_steps": [r["warm_up_steps"] for r in results],
            "compiles": [sum(c or 0 for c in r["compiles"]) for r in results]}


@pytest.mark.parametrize("size,policy,graphs,overlap", [
    (1, "round_robin", False, False), (2, "skewed", False, False),
    (2, "least_loaded", True, True), (4, "skewed", False, True), (4, "round_robin", True, False),
])
def test_dp_logits_equal_the_dp1_reference(size, policy, graphs, overlap, tmp_path, reference,
                                           capsys):
    """The DP 2 case with graphs warms the engines up first: serving after it is unchanged.
    With ``overlap`` a rank launches each step ahead of reading the last one's tokens where its
    own requests allow, whatever the others do."""
    opts = {"n": 10, "policy": policy, "share": 0.7, "graphs": graphs, "seed": size,
            "warm_up": size == 2 and graphs, "overlap": overlap}
    results = _serve(size, opts, tmp_path)
    stats = _check(results, opts, reference)
    ahead = [sum(r["ahead"]) for r in results]
    with capsys.disabled():
        print(f"\n[dp] size={size} policy={policy} graphs={graphs} overlap={overlap} "
              f"ahead={ahead} {stats}")
    assert (max(ahead) > 0) if overlap else (max(ahead) == 0)
    if size > 1:
        assert sum(stats["idle_steps"]) > 0, "the workload must make some rank idle"
    if opts["warm_up"]:
        assert all(r > 0 for r in stats["warm_up_steps"])
    if graphs:
        assert all(g > 0 for g in stats["graph_steps"]), "every rank must replay graphs"
        assert all(g > 0 for g in stats["graph_prefill_steps"]), "prefill graphs run under DP"
        assert sum(stats["peers_variant_steps"]) > 0, "a rank without adapters replays peers"


def test_a_dead_rank_stops_the_others_with_an_error(tmp_path):
    """Ranks as independent processes (as torchrun starts them, without its supervisor):
    rank 1 dies after its first step; rank 0 must fail with an error on its own, in bounded
    time (the collective timeout), not hang."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", DP_TIMEOUT_S="10",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    opts = json.dumps({"n": 6, "die_rank": 1})
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "dp_world.py"), "2", opts,
                               str(tmp_path)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.perf_counter() - t0
    assert procs[1].returncode == 3
    assert procs[0].returncode not in (0, None), outs[0][-2000:]
    error = (tmp_path / "error0.txt").read_text()
    assert "Error" in error or "error" in error, error
    assert elapsed < 60, f"rank 0 took {elapsed:.0f}s to stop"


def _gpu_stats(size: int, results: list[dict], opts: dict, capsys, how: str) -> dict:
    stats = _check(results, opts, _gpu_reference(), torch.bfloat16)
    with capsys.disabled():
        print(f"\n[dp gpu] size={size} {how} policy={opts['policy']} "
              f"graphs={opts['graphs']} {stats}")
    assert sum(stats["idle_steps"]) > 0, "the workload must make some rank idle"
    if opts["graphs"]:
        assert all(g > 0 for g in stats["graph_steps"]), "every rank must replay graphs"
        assert all(g > 0 for g in stats["graph_prefill_steps"]), "prefill graphs run under DP"
        assert sum(stats["peers_variant_steps"]) > 0, "a rank without adapters replays peers"
    assert stats["compiles"] == [0] * size, (
        f"steps compiled kernels after the warm-up: {stats}; "
        f"{[(r['compiled'], r['steps']) for r in results]}")
    return stats


@pytest.mark.gpu
@pytest.mark.parametrize("size,policy,graphs,overlap", [
    (2, "skewed", True, False), (2, "round_robin", True, True), (4, "skewed", True, True),
    (4, "round_robin", False, False), (8, "skewed", True, True), (8, "round_robin", False, False),
])
def test_dp_nccl_bf16(size, policy, graphs, overlap, tmp_path, capsys):
    """One rank per GPU over NCCL, eager and with decode and prefill graphs, serial and
    overlapped. After the warm-up no step compiles a kernel (a compile stalls every rank)."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs (NCCL, one rank per GPU); "
                    f"{torch.cuda.device_count()} present")
    opts = {"n": 8 * size, "policy": policy, "share": 0.8, "graphs": graphs, "seed": 7,
            "cuda": True, "backend": "triton", "warm_up": True, "overlap": overlap}
    _gpu_stats(size, _serve(size, opts, tmp_path), opts, capsys, "spawn")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_torchrun_nccl_on_every_gpu(tmp_path, capsys):
    """The ranks started by torchrun itself, one per GPU of the machine, with graphs: every
    request's logits equal the DP=1 reference."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    size = torch.cuda.device_count()
    opts = {"n": 8 * size, "policy": "skewed", "share": 0.8, "graphs": True, "seed": 11,
            "cuda": True, "backend": "triton", "warm_up": True}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               DP_TIMEOUT_S="60")
    p = subprocess.run([str(torchrun), "--nproc-per-node", str(size), "--master-port",
                        str(free_port()), str(ROOT / "tests" / "dp_world.py"), str(size),
                        json.dumps(opts), str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    _gpu_stats(size, results, opts, capsys, "torchrun")


def test_torchrun_launches_the_dp_benchmark(tmp_path):
    """The same rank code under torchrun (2 gloo processes, a tiny model): rows come back."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    out = tmp_path / "dp.json"
    # gloo on the CPU on any machine (on one GPU, two NCCL ranks would share it: refused)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "-m", "bench.dp_bench", "--preset", "tiny",
                        "--layers", "1", "--adapters", "2", "--loads", "skewed",
                        "--requests-per-rank", "3", "--prompt", "6", "--output", "3",
                        "--max-batch", "4", "--timeout", "30", "--out", str(out)],
                       cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["dp_size"] == 2 and row["verification"]["status"] == "verified"
    assert len(row["derived"]["idle_share_per_rank"]) == 2
    assert row["derived"]["workload"]["requests"] == 6, "3 requests per rank, 2 ranks"
    assert row["derived"]["overlap"] and 0 <= row["derived"]["ahead_steps"] < row["derived"][
        "steps"], "the benchmark serves with the overlapped DP engine"
