"""DP scenario: the serving engine under data-parallel attention, one process a GPU (gloo
processes on a CPU). Per case (DP size, balanced or skewed load, with or without LoRA): the
engine's warm-up (``Engine.warm_up``), an untimed pass of an offline workload, then
``TIMED_PASSES`` timed passes of it (the median reported, with the Triton compiles of every
timed pass: 0 after a complete warm-up), giving output tokens/s, the step times of rank 0,
each rank's share of step time spent in idle forwards, and what one idle forward costs (the
agreed smallest decode bucket replayed with no local rows, in the LoRA, peers and base
variants, in lockstep on every rank).

    python -m bench.dp_bench --sizes 1 2 4 --layers 4 --out results/runs/dp.json
    torchrun --nproc-per-node 4 -m bench.dp_bench --out dp.json   # the ranks started by torchrun
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import provenance, results
from bench.args import at_least, check_out_file, positive
from bench.results import make_row
from bench.scenarios import DP_WORKLOAD, DPCase
from bench.throughput_bench import verify_passes
from bench.timing import Timing
from bench.token_reference import REQUESTS, judge, near_tie, token_reference
from graphs import GraphRunner
from lora_runtime.dp.controller import DPController
from lora_runtime.dp.dp_engine import DPEngine
from lora_runtime.dp.group import checked_timeout_s, init_dp, shutdown
from lora_runtime.dp.launch import spawn
from lora_runtime.dp.shard import shard_mlp
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode, GatheredRows
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.engine.workload import WorkloadSpec, make_workload
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM

OVERLAP = True
"""Serve with ``DPEngine(overlap=True)`` (every rank launching each step before reading the last
one's tokens where it may); ``--serial`` (or ``opts["overlap"] = False``) turns it off."""
TIMED_PASSES = 3
"""Timed passes per case (a pass is 0.3-0.5 s on the H200 and single passes swung by 15%);
the row reports the median one."""
LOADS = {"balanced": ("round_robin", 0.0), "skewed": ("skewed", 0.85)}
WORKLOAD = DP_WORKLOAD
"""A case's workload (fields of its ``DPCase``, as ``overlap`` is) scales with its DP size
(weak scaling): ``requests_per_rank`` times the size, so every size fills its ranks' batches
alike and the sizes compare per rank."""


def run_rank(rank: int, size: int, opts: dict, out: str) -> None:
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda and local >= torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU ("invalid usage") deep inside the first collective.
        raise SystemExit(f"bench.dp_bench: rank {rank} (local {local}) has no GPU of its own: "
                         f"{torch.cuda.device_count()} visible, one rank a GPU (NCCL). Launch "
                         "fewer ranks a node, or run gloo ranks on the CPU with "
                         "CUDA_VISIBLE_DEVICES=''")
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # gloo ranks share the cores: split them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dtype = torch.bfloat16 if cuda else torch.float32
    dp = init_dp(device, opts.get("timeout_s"))  # spawned ranks: DP_TIMEOUT_S wins
    config = PRESETS[opts["preset"]](opts["layers"])
    rows = []
    for c in opts["cases"]:
        rows.append(_case(rank, size, dp, config, device, dtype, c["adapters"], c["load"],
                          c["rank"], opts))
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    shutdown(device)


def _model(config, dtype, device, adapters, r, dp=None):
    """The case's model (weights seed 0; MLP sharded over ``dp`` when given) and its LoRA
    manager (None without adapters)."""
    model = LlamaForCausalLM.random(config, dtype, device, seed=0)
    if dp is not None:
        shard_mlp(model, dp)
    lora = None
    if adapters:
        lora = LoRAManager(model, LoRAConfig(max(adapters, 1), r,
                                             backend="triton" if device.type == "cuda"
                                             else "torch"))
    return model, lora


def _adapter(config, name, r, dtype):
    return random_adapter(config, name, r, seed=int(name.rsplit("-", 1)[1]), dtype=dtype)


def _case(rank, size, dp, config, device, dtype, adapters, load, r, opts) -> dict:
    model, lora = _model(config, dtype, device, adapters, r, dp if size > 1 else None)
    bs = opts["max_batch"]
    requests = opts["requests_per_rank"] * size
    spec = WorkloadSpec(requests, opts["prompt"], opts["output"],
                        popularity="uniform" if adapters else "none",
                        num_adapters=max(adapters, 1), seed=1)
    kv = KVCache(config, bs * (opts["prompt"] + opts["output"]) + 64, dtype, device)
    runner = ModelRunner(model, kv, lora)
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= bs]
    graphs = [GraphRunner.decode(runner, buckets, opts["prompt"] + opts["output"] + 8).capture()]
    overlap = opts.get("overlap", OVERLAP)
    eng = DPEngine(runner, dp, SchedulerConfig(max_batch_size=bs, max_step_tokens=2048), graphs,
                   overlap=overlap)
    for name in spec.adapter_names if adapters else []:
        eng.load_adapter(name, _adapter(config, name, r, dtype))
    warm = eng.warm_up()
    policy, share = LOADS[load]
    passes = []  # per timed pass: (wall, its steps, its output tokens on this rank)
    served = []  # per pass, the untimed first: workload index -> this rank's request
    workload = make_workload(spec, config.vocab_size)
    for timed in (False, *([True] * TIMED_PASSES)):
        eng.keep_logits = not timed  # the untimed pass's rows, for the reference; not timed
        ctrl = DPController(size, policy, share)
        served.append({})
        for i, w in enumerate(workload):  # warm-up serves it too
            if ctrl.assign(len(w.prompt), w.max_new_tokens) == rank:
                served[-1][i] = eng.add_request(w.prompt, w.adapter,
                                                max_new_tokens=w.max_new_tokens)
        first, done = len(eng.timeline), len(eng.finished)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if timed:
            passes.append((time.perf_counter() - t0, eng.timeline[first:],
                           sum(len(r.output) for r in eng.finished[done:])))
    # The median pass by the slowest rank's wall (every rank picks the same pass).
    walls = torch.tensor([p[0] for p in passes], dtype=torch.float64)
    torch.distributed.all_reduce(walls, op=torch.distributed.ReduceOp.MAX, group=dp.cpu_group)
    pick = sorted(range(len(passes)), key=lambda i: float(walls[i]))[len(passes) // 2]
    wall, steps = float(walls[pick]), passes[pick][1]
    tokens = torch.tensor([passes[pick][2]], dtype=torch.int64)
    compiles = torch.tensor([sum(st.compiles or 0 for p in passes for st in p[1])],
                            dtype=torch.int64)
    torch.distributed.all_reduce(compiles, group=dp.cpu_group)
    shares = torch.tensor([_idle_share(steps)], dtype=torch.float64)
    torch.distributed.all_reduce(tokens, group=dp.cpu_group)
    all_shares = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
    torch.distributed.all_gather(all_shares, shares, group=dp.cpu_group)
    idle = {v: _idle_forward_us(eng, graphs[0], v, dp, device, opts.get("idle_reps", 50))
            for v in ("lora", "peers", "base")}  # None: this runtime has no such variant
    graphs.clear()
    eng.graphs.clear()  # captured collectives must be released before leaving the group
    case = DPCase(opts["preset"], opts["layers"], str(dtype).removeprefix("torch."), size, load,
                  adapters, str(r) if adapters else "-", **{k: opts[k] for k in WORKLOAD},
                  overlap=overlap)
    per_rank = [float(s) for s in all_shares]
    derived = {
        "output_tokens_per_s": int(tokens) / wall, "requests_per_s": requests / wall,
        "output_tokens": int(tokens), "duration_s": wall, "steps": len(steps),
        "ahead_steps": sum(st.ahead for st in steps), "overlap": eng.overlap,
        "pass_walls_s": [float(w) for w in walls],
        "idle_share": sum(per_rank) / size, "idle_share_per_rank": per_rank,
        "warm_up_s": warm.seconds,
        "timed_compiles": None if warm.compiles is None else int(compiles),
        "graph_steps": sum(st.graph for st in steps),
        "eager_seconds_share": sum(st.seconds for st in steps if not st.graph)
        / max(1e-9, sum(st.seconds for st in steps)),
        "idle_forward_us": next(idle[v] for v in ("peers", "lora", "base")
                                if idle[v] is not None),  # what an idle rank replays
        **{f"idle_forward_{v}_us": us for v, us in idle.items()},
        "ranks_run_on": min(size, max(torch.cuda.device_count(), 1)) if device.type == "cuda"
        else 0,
        "workload": {"requests": requests} | {k: opts[k] for k in WORKLOAD},
    }
    timing = Timing([s.seconds * 1e6 for s in steps], "wall") if steps else None
    untimed = served[0]
    expected = sum(w.max_new_tokens for w in workload)
    verification = {"status": "verified" if int(tokens) == expected else "failed",
                    "error": None if int(tokens) == expected else
                    f"the timed pass produced {int(tokens)} tokens, the workload's "
                    f"max_new_tokens sum to {expected}",
                    "checked": "every request produced max_new_tokens tokens; every timed "
                               "pass repeats the untimed pass's tokens up to a near-tie"}
    # The timed passes' tokens (a count cannot see wrong ones) against the untimed pass's.
    try:  # raising on one rank would leave the others in the gather
        repeat = _repeats_untimed(eng, served, workload, dtype)
    except Exception as e:  # noqa: BLE001 - any failure of the check fails the case
        repeat = {"status": "failed", "error": f"the check raised {type(e).__name__}: {e}"}
    repeats = [None] * size
    torch.distributed.all_gather_object(repeats, repeat, group=dp.cpu_group)
    failed = next(((r, v) for r, v in enumerate(repeats) if v["status"] != "verified"), None)
    if verification["status"] == "verified" and failed is not None:
        verification = {**verification, "status": "failed",
                        "error": f"rank {failed[0]}'s requests: {failed[1]['error']}"}
    # Every rank's untimed-pass tokens, by workload index, against an eager forward of an
    # unsharded copy of the model on rank 0 (a count cannot see wrong tokens).
    mine = [None] * size
    torch.distributed.all_gather_object(mine, {i: list(q.output) for i, q in untimed.items()},
                                        group=dp.cpu_group)
    # And the logits rows at the probed tokens (a token shows only a fault that flips it).
    rows = [None] * size
    torch.distributed.all_gather_object(rows, _probe_rows(eng, untimed), group=dp.cpu_group)
    eng.logits.clear()
    if rank == 0 and verification["status"] == "verified":
        # Rank 0 alone: raising here would leave the other ranks in the next case's collectives.
        try:
            verification = _verify_reference(config, dtype, device, adapters, r, spec, mine,
                                             verification, rows)
        except Exception as e:  # noqa: BLE001 - any failure of the check fails the case
            verification = {"status": "failed",
                            "error": f"the token reference raised {type(e).__name__}: {e}"}
    row = make_row(case, opts["profile"], {}, timing=timing, derived=derived,
                   verification=verification)  # a failed one keeps neither
    if rank == 0:
        print(f"[dp] size={size} {load:8} adapters={adapters:2} "
              f"{derived['output_tokens_per_s']:9.1f} tok/s  idle share per rank "
              f"{[round(s, 3) for s in per_rank]}  idle forward lora/peers/base "
              f"{'/'.join('-' if us is None else f'{us:.1f}' for us in idle.values())} us",
              flush=True)
    return row


def _repeats_untimed(eng, served: list[dict], workload, dtype) -> dict:
    """This rank's timed passes (``served[1:]``) against its untimed pass (``served[0]``,
    whose logits rows the engine kept): ``throughput_bench.verify_passes``'s outcome."""
    order = sorted(served[0])
    margins = {j: [float(t[0] - t[1]) for t in (row.float().topk(2).values for row in
                                                 eng.logits.get(served[0][i].id, []))]
               for j, i in enumerate(order)}
    passes = [[list(p[i].output) for i in order] for p in served]
    return verify_passes(passes, [workload[i] for i in order], margins,
                         near_tie(str(dtype).removeprefix("torch.")))


def _probe_rows(eng, untimed: dict) -> dict:
    """workload index -> {output position: the engine's logits row there} at the positions
    ``token_reference`` probes (first and last output token of this rank's first
    ``REQUESTS`` requests), on the host."""
    out = {}
    for i in sorted(untimed)[:REQUESTS]:
        kept = eng.logits.get(untimed[i].id, [])
        if kept:
            out[i] = {k: kept[k].float().cpu() for k in {0, len(kept) - 1}}
    return out


def _verify_reference(config, dtype, device, adapters, r, spec, parts,
                      verification: dict, rows=None) -> dict:
    """``parts`` (per rank: workload index -> that rank's tokens; or one such dict) against
    ``token_reference`` on an unsharded model with the same weights (seed 0) and adapters:
    the first ``REQUESTS`` requests of *each* rank, judged rank by rank (under a skewed load
    the workload's first requests nearly all go to rank 0, and one rank's share of the
    probes fits within the bf16 allowance of the whole)."""
    parts = [parts] if isinstance(parts, dict) else list(parts)
    workload = make_workload(spec, config.vocab_size)
    model, lora = _model(config, dtype, device, adapters, r)
    for name in spec.adapter_names if adapters else []:
        lora.load_adapter(name, _adapter(config, name, r, dtype))
    tie = near_tie(str(dtype).removeprefix("torch."))
    outs = [[] for _ in workload]
    for part in parts:
        for i, o in part.items():
            outs[i] = list(o)
    check = (f"first and last tokens of the first {REQUESTS} requests of every rank == an "
             "eager forward outside the engine")
    done = {**verification, "checks": [verification["checked"]]}
    probes = mismatches = 0
    worst, worst64, checks = 0.0, 0.0, [check]
    for rank, part in enumerate(parts):
        kept = None if rows is None else {i: {k: t.to(device) for k, t in ks.items()}
                                          for i, ks in rows[rank].items()}
        found = token_reference(model, lora, workload, outs, tie, sorted(part)[:REQUESTS],
                                engine_logits=kept)
        v = judge(found, model, tie, done, check)
        if v["status"] != "verified":
            return {**v, "error": f"rank {rank}'s requests: {v['error']}"}
        probes += v["reference_probes"]
        mismatches += v["reference_mismatches"]
        worst = max(worst, v.get("max_rel_err_logits_vs_eager", 0.0))
        worst64 = max(worst64, v.get("max_rel_err_logits_vs_float64", 0.0))
        checks = v["checks"][len(done["checks"]):]
    extra = {"max_rel_err_logits_vs_float64": worst64}
    if rows is not None:
        extra["max_rel_err_logits_vs_eager"] = worst
    return {**done, "reference_probes": probes, "reference_mismatches": mismatches, **extra,
            "checks": [*done["checks"], *checks]}


def _idle_share(steps) -> float:
    total = sum(s.seconds for s in steps)
    return sum(s.seconds for s in steps if s.mode == "idle") / total if total else 0.0


def _idle_forward_us(eng, graph, variant: str, dp, device, reps: int = 50) -> float | None:
    """Every rank replays the smallest decode bucket with no local rows (an all-idle step's
    forward) in ``variant`` (``peers``: what an idle rank replays while its peers' rows have
    adapters; ``lora``: the full variant, its attention-side LoRA launching for nothing);
    median wall time per forward, synced, in us; None where the runtime lacks the variant."""
    bucket = graph.buffers.buckets[0]
    if variant != "base" and (eng.lora is None or (variant, bucket) not in graph.graphs):
        return None
    gathered = GatheredRows(ForwardMode.DECODE, bucket, ((),) * dp.size, ((),) * dp.size)
    batch = ForwardBatch.idle(eng.lora, device, gathered)
    samples = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        graph.replay(batch, bucket, variant)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _run_record(argv: list[str] | None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    command = ["python", "-m", "bench.dp_bench", *(sys.argv[1:] if argv is None else argv)]
    return (provenance.collect(device, command)
            | {"profile": "gpu" if device.type == "cuda" else "cpu"})


def check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """Before any rank starts: the result file can be written and, where it exists, read (the
    run adds its rows to it)."""
    check_out_file(p, "--out", out)
    if out.suffix != ".json":  # written anyway, then refused by bench.report and by the next
        # run into it as not a result file
        p.error(f"--out {out}: result files end in .json (bench.report and the next run read "
                f"them by it): give e.g. {out.with_suffix('.json')}")
    if out.exists():
        try:
            results.load(out)
        except results.ResultFileError as e:
            p.error(f"--out: {e} (this run would add its rows to it)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dp_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive, nargs="+", default=None,
                   help="DP sizes to spawn (default 1 2; under torchrun the world size)")
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--adapters", type=at_least(0), nargs="+", default=[0, 4])
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("--rank", type=positive, default=16)
    p.add_argument("--requests-per-rank", type=positive, default=64,
                   help="requests of a case per DP rank (a case of size N serves N times this)")
    p.add_argument("--prompt", type=positive, default=128)
    p.add_argument("--output", type=positive, default=64)
    p.add_argument("--max-batch", type=positive, default=32)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--serial", action="store_true",
                   help="serve without overlap (each step waits for the last one's tokens)")
    p.add_argument("--out", type=Path, required=True,
                   help="result file (rows upserted by case, as python -m bench writes)")
    args = p.parse_args(argv)
    try:  # spawn would refuse it, with a traceback
        checked_timeout_s(args.timeout)
    except ValueError as e:
        p.error(f"--timeout: {e}")
    check_out(p, args.out)
    for flag in ("sizes", "adapters", "loads"):  # a case run twice, two rows of it in --out
        values = getattr(args, flag) or []
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            p.error(f"--{flag} {' '.join(map(str, values))}: {twice} is given twice")
    opts = {k: getattr(args, k) for k in ("preset", "layers", *WORKLOAD)}
    opts["cases"] = [{"adapters": a, "load": load, "rank": args.rank}
                     for a in args.adapters for load in args.loads]
    opts["profile"] = "gpu" if torch.cuda.is_available() else "cpu"
    opts["overlap"] = not args.serial
    opts["timeout_s"] = args.timeout  # under torchrun no spawn passes it on
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        size = int(os.environ["WORLD_SIZE"])
        if args.sizes not in (None, [size]):
            p.error(f"--sizes {' '.join(map(str, args.sizes))}: under torchrun the DP size is "
                    f"the world size ({size}); drop --sizes or start torchrun with that many")
        part = args.out.with_suffix(f".dp{size}.json")
        run_rank(int(os.environ["RANK"]), size, opts, str(part))
        if int(os.environ["RANK"]) == 0:
            rows = _reproducible(json.loads(part.read_text()), args)
            results.upsert(args.out, _run_record(argv), rows)
            part.unlink()
            print(f"wrote {args.out}")
            return _exit_status(rows)
        return 0
    run, rows = _run_record(argv), []
    for size in args.sizes or [1, 2]:
        part = args.out.with_suffix(f".dp{size}.json")
        spawn(run_rank, size, size, opts, str(part), timeout_s=args.timeout)
        new = _reproducible(json.loads(part.read_text()), args)
        results.upsert(args.out, run, new)
        rows += new
        part.unlink()
    print(f"wrote {args.out}")
    return _exit_status(rows)


def _reproducible(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """``rows`` with this tool's command for each case: the ranks make them with the ``python
    -m bench`` one, which runs the profile's workload, and matches no case where the tool ran
    another model or load."""
    return [r | {"reproduce": reproduce(r, args)} for r in rows]


def reproduce(row: dict, args: argparse.Namespace) -> str:
    """The command that runs ``row``'s case alone, with the workload of this run."""
    argv = ["--sizes", row["dp_size"], "--preset", args.preset, "--layers", args.layers,
            "--adapters", row["adapters"], "--loads", row["load"], "--rank", args.rank,
            *(x for k in WORKLOAD for x in (f"--{k.replace('_', '-')}", getattr(args, k))),
            "--timeout", args.timeout, *(["--serial"] if args.serial else []),
            "--out", args.out]
    return " ".join(shlex.quote(str(a)) for a in ["python", "-m", "bench.dp_bench", *argv])


def _exit_status(rows: list[dict]) -> int:
    """1 when a case failed its verification, naming each (a run whose cases failed exited 0,
    as if every row were good), as ``python -m bench`` does."""
    bad = [r for r in rows if r["verification"]["status"] == "failed"]
    for r in bad:
        print(f"FAILED {r['label']}: {r['verification']['error']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
