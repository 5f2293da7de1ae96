"""One DP rank of the control-path tests (spawned processes): what must be decided alike on
every rank, or refused alike, for the ranks to stay in lockstep. Each scenario records what
happened on this rank; ``tests/test_dp_control.py`` compares the ranks."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch
from dp_world import CONFIG, SLOTS, adapters
from runtime_helpers import ALL_TARGETS

from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.dp.shard import shard_mlp
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.llama import LlamaForCausalLM

PROMPTS = {"ad0": [1, 2, 3], "ad1": [4, 5, 6, 7], "ad2": [8, 9], "ad3": [5, 5, 1]}


def control_rank(rank: int, size: int, out_dir: str) -> None:
    dp = init_dp(torch.device("cpu"))
    eng = DPEngine(_sharded_runner(dp), dp, SchedulerConfig(max_batch_size=4, max_step_tokens=16),
                   keep_logits=True)
    ads = adapters()
    # The same adapters in another order on each rank: their names, not the order, count.
    for ad in ads if rank == 0 else ads[::-1]:
        eng.load_adapter(ad.name, ad)
    log: dict[str, object] = {}

    def attempt(key, fn):
        try:
            fn()
            log[key] = "ok"
        except (ValueError, RuntimeError) as e:
            log[key] = f"{type(e).__name__}: {e}"

    # Rank 0 runs ad0 and ad1, rank 1 ad2: every slot is held.
    mine = ["ad0", "ad1"] if rank == 0 else ["ad2"]
    reqs = {a: eng.add_request(PROMPTS[a], a, max_new_tokens=6) for a in mine}
    for _ in range(2):
        eng.step()
    attempt("pin ad3", lambda: eng.pin_adapter("ad3"))
    attempt("unload ad0", lambda: eng.unload_adapter("ad0"))
    eng.run()
    log["outputs"] = {a: (list(r.output), [t.clone() for t in eng.logits[r.id]])
                      for a, r in reqs.items()}
    # generate: each rank its own lengths; every rank returns once no rank has work.
    log["generate"] = eng.generate([[3, 1, 4]], [None], 2 if rank == 0 else 5)
    # Every slot pinned, and a request on a fourth adapter on rank 0: no rank can ever run.
    for a in ("ad0", "ad1", "ad2"):
        eng.pin_adapter(a)
    if rank == 0:
        eng.add_request([5, 5], "ad3", max_new_tokens=2)
    attempt("stuck", lambda: eng.run(max_steps=50))
    log["stuck steps"] = len(eng.timeline)
    torch.save(log, Path(out_dir, f"control{rank}.pt"))
    shutdown(torch.device("cpu"))


def overlap_control_rank(rank: int, size: int, out_dir: str) -> None:
    """With overlap, ranks whose requests allow a different run-ahead still return from each
    ``step()`` together: a control call's collective after one step pairs with the other
    rank's. Then engines the ranks build differently are refused on every rank."""
    dp = init_dp(torch.device("cpu"))
    model = LlamaForCausalLM.random(CONFIG, torch.float32, "cpu", seed=0)
    shard_mlp(model, dp)
    lora = LoRAManager(model, LoRAConfig(SLOTS, 8, ALL_TARGETS, "torch"))
    runner = ModelRunner(model, KVCache(CONFIG, 200, torch.float32, "cpu"), lora)
    eng = DPEngine(runner, dp, SchedulerConfig(max_batch_size=4, max_step_tokens=16),
                   keep_logits=True, overlap=True)
    for ad in adapters():
        eng.load_adapter(ad.name, ad)
    log: dict[str, object] = {}
    # Rank 0's request runs ahead after its first token; rank 1's ends with its first.
    name, n = ("ad0", 6) if rank == 0 else ("ad2", 1)
    req = eng.add_request(PROMPTS[name], name, max_new_tokens=n)
    eng.step()
    eng.unload_adapter("ad3")  # its all-gather must pair with the other rank's
    for _ in range(2):
        eng.step()
    eng.pin_adapter("ad1")
    eng.run()
    log["outputs"] = {name: (list(req.output), [t.clone() for t in eng.logits[req.id]])}
    log["ahead"] = [s.ahead for s in eng.timeline]
    # A cache of exactly one request's budget (prompt 3 + 6 - 1): a step run ahead past its
    # last token would ask for a ninth slot.
    tight = DPEngine(ModelRunner(model, KVCache(CONFIG, 8, torch.float32, "cpu"), lora), dp,
                     SchedulerConfig(max_batch_size=4, max_step_tokens=16), overlap=True)
    log["tight"] = tight.generate([[1, 2, 3]], ["ad0"], 6 if rank == 0 else 3)
    # One free slot (ad1 and ad3 pinned): rank 0's stream of requests on ad0 keeps it, and
    # rank 1's request on ad2 waited until the whole stream was served (a single engine stops
    # admitting after max_overtake_steps; across ranks nothing did).
    fair = DPEngine(runner, dp, SchedulerConfig(max_batch_size=2, max_step_tokens=16,
                                                max_overtake_steps=2), overlap=True)
    fair.load_adapter("ad3", adapters()[3], pinned=True)
    prompts = [[1 + i, 2, 3] for i in range(10)] if rank == 0 else [PROMPTS["ad2"]]
    log["fair"] = fair.generate(prompts, ["ad0" if rank == 0 else "ad2"] * len(prompts), 3)
    log["fair last served"] = max(i for i, s in enumerate(fair.timeline) if s.mode != "idle")
    fair.unload_adapter("ad3")
    runner.lora.reset_lora_batch()
    try:  # another max_batch_size on rank 1: the agreement's tensors would differ in size
        DPEngine(runner, dp, SchedulerConfig(max_batch_size=4 + rank))
        log["mismatch"] = "ok"
    except ValueError as e:
        log["mismatch"] = str(e)
    # The refused engine left the manager's hooks to the engine that served last.
    log["hooks kept"] = [getattr(h, "__self__", None) is fair
                         for h in (runner.lora.evict_last, runner.lora.requested)]
    plain = LlamaForCausalLM.random(CONFIG, torch.float32, "cpu", seed=0)
    try:
        DPEngine(ModelRunner(plain, KVCache(CONFIG, 64, torch.float32, "cpu"), None), dp)
        log["unsharded"] = "ok"
    except ValueError as e:
        log["unsharded"] = str(e)
    torch.save(log, Path(out_dir, f"overlap{rank}.pt"))
    shutdown(torch.device("cpu"))


def diverging_rank(rank: int, size: int, out_dir: str) -> None:
    """Ranks whose calls or set-ups diverge: each divergence raises on every rank, and the
    ranks go on serving in step afterwards."""
    from dataclasses import replace

    from graphs.runner import GraphRunner

    dp = init_dp(torch.device("cpu"))
    runner = _sharded_runner(dp)
    model, lora = runner.model, runner.lora
    cfg = SchedulerConfig(max_batch_size=4, max_step_tokens=16)
    eng = DPEngine(runner, dp, cfg, keep_logits=True)
    ads = adapters()
    for ad in ads:
        if ad.name == "ad1" and rank == 1:  # other weights under the same name
            mods = {k: replace(m, b=m.b * 1.5) for k, m in ad.modules.items()}
            ad = replace(ad, modules=mods)
        eng.load_adapter(ad.name, ad)
    log: dict[str, object] = {}
    attempt = functools.partial(_attempt, log)

    attempt("same name, other weights", lambda: eng.generate([PROMPTS["ad0"]], ["ad0"], 6))
    eng.unload_adapter("ad1")  # the fix, on every rank; the request on ad0 stays queued
    eng.load_adapter("ad1", ads[1])
    req = eng.scheduler.waiting[0] if eng.scheduler.waiting else eng.scheduler.running[0]
    eng.run()
    log["outputs"] = {"ad0": (list(req.output), [t.clone() for t in eng.logits[req.id]])}
    # A bad prompt on rank 1 only: refused there, rank 0 served, and the next calls pair up.
    bad = [[CONFIG.vocab_size + 5]] if rank == 1 else [PROMPTS["ad2"]]
    attempt("bad generate", lambda: eng.generate(bad, ["ad2"], 4))
    attempt("next generate", lambda: eng.generate([[3, 1, 4]], [None], 2 + rank))
    # warm_up with a request queued on rank 0 only: refused on every rank.
    if rank == 0:
        eng.add_request([5, 6], None, max_new_tokens=2)
    attempt("warm_up", lambda: eng.warm_up())
    eng.run()
    # A control call on rank 0 while rank 1 steps: both name the other's call.
    attempt("diverging call",
            lambda: eng.unload_adapter("ad3") if rank == 0 else eng.step())
    log["after"] = eng.generate([[2, 7]], ["ad3"], 3)
    # With overlap, an agreement that raises while a step is in flight: that step's tokens
    # are taken first (rank 1 loads an adapter alone, between two steps).
    ahead = DPEngine(runner, dp, cfg, keep_logits=True, overlap=True)
    req = ahead.add_request(PROMPTS["ad0"], "ad0", max_new_tokens=6)
    ahead.step()
    ahead.step()
    if rank == 1:
        lora.load_adapter("extra", ads[2])
    attempt("ahead", ahead.step)
    if rank == 1:
        lora.unload_adapter("extra")
    ahead.run()
    log["ahead outputs"] = {"ad0": (list(req.output), [t.clone() for t in ahead.logits[req.id]])}
    for key, other in (("step tokens", replace(cfg, max_step_tokens=16 + 16 * rank)),
                       ("chunked", replace(cfg, chunked_prefill=rank == 0))):
        attempt(key, lambda other=other: DPEngine(runner, dp, other))
    graphs = [GraphRunner.decode(runner, [1, 2 + 2 * rank], 64)]
    attempt("graphs", lambda: DPEngine(runner, dp, cfg, graphs))
    small = ModelRunner(model, KVCache(CONFIG, 100 + 100 * rank, torch.float32, "cpu"), lora)
    attempt("kv", lambda: DPEngine(small, dp, cfg))
    torch.save(log, Path(out_dir, f"diverging{rank}.pt"))
    shutdown(torch.device("cpu"))


def fault_rank(rank: int, size: int, out_dir: str) -> None:
    from graphs.runner import GraphRunner

    """Graphs none of which was captured: every step runs eagerly, as a single engine's do.
    A pin made on one rank only: every rank raises at the next agreement, before any
    forward (it went unseen: that rank alone found no slot mid-step and its peers' collectives
    waited), and once it is undone the requests are served. Then rank 0's forward raises
    mid-step: every later call of that rank raises, naming the fault, without a collective
    (a step retried there paired its agreement with rank 1's MLP all-gather, and gloo aborted
    the process); rank 1 fails in its collective once rank 0 has gone, and so do its later
    calls."""
    dp = init_dp(torch.device("cpu"))
    eng = DPEngine(_sharded_runner(dp), dp, SchedulerConfig(max_batch_size=4, max_step_tokens=16),
                   keep_logits=True)
    for ad in adapters():
        eng.load_adapter(ad.name, ad)
    log: dict[str, object] = {}
    attempt = functools.partial(_attempt, log)

    # Graphs whose capture failed (none captured, on every rank): the steps run eagerly.
    uncaptured = DPEngine(eng.runner, dp, SchedulerConfig(max_batch_size=4, max_step_tokens=16),
                          [GraphRunner.decode(eng.runner, [1, 4], 48)], keep_logits=True)
    attempt("uncaptured", lambda: uncaptured.generate([PROMPTS["ad2"]], ["ad2"], 3))
    eng.generate([[1, 2]], ["ad0"], 2)  # ad0 takes a slot on every rank
    if rank == 0:
        eng.pin_adapter("ad0")
    # With ad0 pinned on rank 0 alone, the union the ranks admit outgrows its slots there.
    reqs = {a: eng.add_request(PROMPTS[a], a, max_new_tokens=3)
            for a in (["ad3"] if rank == 0 else ["ad1", "ad2"])}
    attempt("one rank pins", eng.step)
    if rank == 0:
        eng.pin_adapter("ad0", False)  # the fix: pins alike on every rank
    eng.run()
    log["outputs"] = {a: (list(r.output), [t.clone() for t in eng.logits[r.id]])
                      for a, r in reqs.items()}
    req = uncaptured.finished[0] if uncaptured.finished else None
    log["uncaptured outputs"] = {} if req is None else {
        "ad2": (list(req.output), [t.clone() for t in uncaptured.logits[req.id]])}
    eng.add_request(PROMPTS["ad1"], "ad1", max_new_tokens=4)
    eng.step()
    if rank == 0:
        fail_next_forward(eng)
    attempt("fault", eng.step)  # rank 1 waits in the MLP's all-gather until rank 0 has gone
    attempt("step after", eng.step)
    attempt("unload after", lambda: eng.unload_adapter("ad3"))
    torch.save(log, Path(out_dir, f"fault{rank}.pt"))
    # No shutdown: the ranks' collectives no longer pair; this process leaving is rank 1's
    # error. As tests/test_dp_fault_calls.py: a failed gloo pair may abort at exit (1 run of
    # this test in 4 on 2 cores with torch 2.14).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_runner(dp) -> ModelRunner:
    """The tiny model with its MLP sharded over ``dp``, SLOTS LoRA slots (torch backend)."""
    model = LlamaForCausalLM.random(CONFIG, torch.float32, "cpu", seed=0)
    shard_mlp(model, dp)
    lora = LoRAManager(model, LoRAConfig(SLOTS, 8, ALL_TARGETS, "torch"))
    return ModelRunner(model, KVCache(CONFIG, 200, torch.float32, "cpu"), lora)


def _attempt(log: dict, key: str, fn) -> None:
    """``log[key]``: what ``fn()`` returned, or the error it raised, as text."""
    try:
        log[key] = fn()
    except (ValueError, RuntimeError) as e:
        log[key] = f"{type(e).__name__}: {e}"


def timed(log: dict, key: str, fn) -> None:
    """``log[key]``: "ok" or the error ``fn()`` raised, as text; ``log[key + " s"]``: seconds."""
    t0 = time.monotonic()
    try:
        fn()
        log[key] = "ok"
    except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
        log[key] = f"{type(e).__name__}: {e}"
    log[key + " s"] = time.monotonic() - t0


def fail_next_forward(eng) -> None:
    """``eng``'s next eager forward raises "injected fault" (once)."""
    real = eng.runner.forward_eager

    def fail_once(batch):
        eng.runner.forward_eager = real
        raise RuntimeError("injected fault")

    eng.runner.forward_eager = fail_once
