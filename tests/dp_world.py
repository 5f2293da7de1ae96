"""One DP rank of the data-parallel tests (run in spawned processes), and the shared recipe
that the DP=1 reference uses too: the same base weights, adapters and workload."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch
from runtime_helpers import ALL_TARGETS

from graphs import GraphRunner
from kernels import jit_watch
from lora_runtime.dp.controller import DPController
from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.dp.launch import spawn
from lora_runtime.dp.shard import shard_mlp
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CONFIG = tiny(2)
SLOTS, MAX_RANK = 3, 8
DECODE_BUCKETS, PREFILL_BUCKETS = [1, 4], [32]


def adapters(n: int = 4):
    """The adapters every rank (and the reference) loads, in this order."""
    out = []
    for i in range(n):
        targets = ALL_TARGETS if i % 2 == 0 else ("q_proj", "v_proj", "gate_proj", "down_proj")
        out.append(random_adapter(CONFIG, f"ad{i}", 2 + 2 * i, targets, seed=100 + i,
                                  b_std=0.3, alpha=float(3 + i)))
    return out


def workload(seed: int, n: int) -> list[tuple[list[int], str | None, int]]:
    """(prompt, adapter, max_new_tokens): a mix with and without adapters, and a tail of
    base-only requests so some steps have no adapter on any rank."""
    rng = random.Random(seed)
    names = [None, "ad0", "ad1", "ad2", "ad3"]
    out = []
    for i in range(n):
        adapter = None if i >= n - 3 else rng.choice(names)
        prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 20))]
        out.append((prompt, adapter, rng.randint(1, 5)))
    return out


def serve_rank(rank: int, size: int, opts: dict, out_dir: str) -> None:
    """Serves this rank's share of the workload; saves its requests' tokens and logits."""
    device = torch.device(f"cuda:{rank}" if opts.get("cuda") else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if opts.get("cuda") else torch.float32
    dp = init_dp(device)
    model = LlamaForCausalLM.random(CONFIG, dtype, device, seed=0)
    if size > 1:
        shard_mlp(model, dp)
    lora = LoRAManager(model, LoRAConfig(SLOTS, MAX_RANK, ALL_TARGETS, opts.get("backend",
                                                                                 "torch")))
    runner = ModelRunner(model, KVCache(CONFIG, 400, dtype, device), lora)
    graphs = []
    if opts.get("graphs"):
        graphs = [GraphRunner.decode(runner, DECODE_BUCKETS, 48).capture(),
                  GraphRunner.prefill(runner, PREFILL_BUCKETS, 4, 64).capture()]
    eng = DPEngine(runner, dp, SchedulerConfig(max_batch_size=4, max_step_tokens=16), graphs,
                   keep_logits=True, overlap=opts.get("overlap", False))
    for ad in adapters():
        eng.load_adapter(ad.name, ad.to(dtype))
    if rank == opts.get("die_rank", -1):
        eng.add_request([1, 2, 3], None, max_new_tokens=4)
        eng.step()
        os._exit(3)  # a rank dies between steps
    warm = eng.warm_up() if opts.get("warm_up") else None
    jit0 = jit_watch.count()
    ctrl = DPController(size, opts.get("policy", "round_robin"), opts.get("share", 0.75))
    mine = {}
    for i, (prompt, adapter, new) in enumerate(workload(opts.get("seed", 0), opts["n"])):
        if ctrl.assign(len(prompt), new) == rank:
            mine[i] = eng.add_request(prompt, adapter, max_new_tokens=new)
    t0 = time.perf_counter()
    try:
        while True:  # DPEngine.run, with a check after each step
            eng.step()
            last = eng.timeline[-1] if eng.timeline else None
            if last is not None and last.variant == "peers":
                assert eng.lora.backend.batch_info is None, \
                    "the peers variant ran LoRA on the rank's own rows"
            if not eng.last.has_work:
                break
    except Exception as e:
        Path(out_dir, f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}\n"
                                                     f"after {time.perf_counter() - t0:.1f}s")
        raise
    result = {
        "requests": {i: (r.output, [row.float().cpu() for row in eng.logits[r.id]])
                     for i, r in mine.items()},
        "modes": [s.mode for s in eng.timeline],
        "ahead": [s.ahead for s in eng.timeline],
        "graph_steps": sum(s.graph for s in eng.timeline),
        "graph_prefill_steps": sum(s.graph and s.mode == "extend" for s in eng.timeline),
        "variants": [s.variant for s in eng.timeline],
        "compiles": [s.compiles for s in eng.timeline],
        "warm_up_steps": warm.steps if warm else 0,
        "compiled": [] if jit0 is None else jit_watch.names_since(jit0),
        "steps": [(s.mode, s.batch_size, s.tokens, s.graph, s.compiles) for s in eng.timeline],
    }
    torch.save(result, Path(out_dir, f"rank{rank}.pt"))
    graphs.clear()
    eng.graphs.clear()  # captured collectives must be released before leaving the group
    del eng
    shutdown(device)


if __name__ == "__main__":  # one rank as its own process: python tests/dp_world.py SIZE OPTS DIR
    import json
    import sys

    serve_rank(int(os.environ["RANK"]), int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])


def spawned_logs(target, out_dir, stem: str, *args, timeout_s: float = 5.0,
                 ranks: int = 2) -> list:
    """Runs ``target(rank, *args, str(out_dir))`` on ``ranks`` gloo ranks, each of which saves
    its log as ``{stem}{rank}.pt`` in ``out_dir``; within a minute (the collectives'
    ``timeout_s`` bounds a hang), then loads the logs."""
    t0 = time.monotonic()
    spawn(target, ranks, *args, str(out_dir), timeout_s=timeout_s)
    assert time.monotonic() - t0 < 60
    return [torch.load(Path(out_dir) / f"{stem}{r}.pt") for r in range(ranks)]
