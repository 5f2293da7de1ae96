"""The base decode step (no LoRA, graph replay only) with the torch reference kernels and
with the Triton ones (attention, RMSNorm, RoPE + KV write, SwiGLU), next to its floors
(``bench.step_floor``: bytes, and the roofline once the GEMMs are compute-bound), judged
against ceilings measured in the same run. ``profile_step`` lists where a replay's device
time goes, by kernel.

``python -m bench.base_step_bench [--layers 4] [--contexts 512 4096] [--batch-sizes 1 8 64 256]
[--profile 256 512] [--json out.json]`` prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.args import check_out_file, positive
from bench.base_step_suite import decode_batch
from bench.hardware import Ceilings, measure
from bench.step_floor import StepFloor
from bench.timing import bench_time
from graphs import GraphRunner
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM


def run_base_step(device: torch.device, dtype: torch.dtype, *, preset: str = "llama3-8b",
                  layers: int = 4, batch_sizes=(1, 8, 64, 256), contexts=(512, 4096),
                  reps: int = 20, ceil: Ceilings | None = None, profile=(),
                  backends=("torch", "triton")) -> list[dict]:
    """One row per (context, backend, batch size). ``profile``: (bs, context) pairs whose
    replays also print their per-kernel breakdown with each backend."""
    ceil = ceil or measure(device, dtype)
    config = PRESETS[preset](layers)
    model = LlamaForCausalLM.random(config, dtype, device)
    kv = KVCache(config, max(batch_sizes) * (max(contexts) + 1) + 8, dtype, device)
    for cache in kv.k + kv.v:  # random, not zeros: zeros can run faster than real data
        cache.normal_()
    runner = ModelRunner(model, kv, None)
    floor = StepFloor.of(model)
    rows = []
    for ctx in contexts:
        for backend in backends:
            with use_base_backend(backend):
                graphs = GraphRunner.decode(runner, list(batch_sizes), ctx + 8).capture()
            for bs in batch_sizes:
                reqs, batch = decode_batch(kv, bs, ctx, device)
                graphs.replay(batch)  # refreshes the static buffers
                replay = graphs.graphs[(graphs.last_kind, graphs.buffers.bucket_for(batch))].replay
                t = bench_time(replay, device=device, mode="events", reps=reps, warmup=3)
                if (bs, ctx) in profile:
                    profile_step(replay, f"{preset} L={layers} bs={bs} ctx={ctx} {backend}")
                f = floor.us(bs, ctx, ceil)
                rows.append({
                    "suite": "base_step", "preset": preset, "layers": layers, "batch_size": bs,
                    "context": ctx, "attention": backend,
                    "dtype": str(dtype).removeprefix("torch."),
                    "median_us": t.median_us, "p20_us": t.quantile(0.2),
                    "p80_us": t.quantile(0.8), "floor_bytes": floor.bytes(bs, ctx), **f,
                    "pct_of_bytes_floor": 100 * f["bytes_floor_us"] / t.median_us,
                    "pct_of_roofline": 100 * f["roofline_floor_us"] / t.median_us,
                    "copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops,
                })
                kv.free([s for r in reqs for s in r.kv_slots])
            del graphs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def profile_step(fn, label: str, top: int = 12) -> None:
    """Device time per kernel name over 5 calls of ``fn``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"\n-- {label}: device time per kernel (5 replays)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top,
                                    max_name_column_width=60))


def format_table(rows: list[dict]) -> str:
    lines = ["| layers | bs | context | kernels | step us | bytes floor us | % of it | "
             "roofline us | % of it |", "|--:|--:|--:|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['batch_size']} | {r['context']} | {r['attention']} | "
                     f"{r['median_us']:.0f} | {r['bytes_floor_us']:.0f} | "
                     f"{r['pct_of_bytes_floor']:.0f}% | {r['roofline_floor_us']:.0f} | "
                     f"{r['pct_of_roofline']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.base_step_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--contexts", type=positive, nargs="+", default=[512, 4096])
    parser.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--backends", nargs="+", default=["torch", "triton"],
                        choices=["torch", "triton"])
    parser.add_argument("--profile", type=positive, nargs=2, action="append", default=[],
                        metavar=("BS", "CONTEXT"), help="kernel breakdown of that replay "
                        "(repeatable)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.json:
        check_out_file(parser, "--json", args.json)
    if args.profile and not torch.cuda.is_available():
        parser.error("--profile BS CONTEXT lists a replay's CUDA kernels: it needs a GPU")
    for bs, context in args.profile:  # a pair the sweep never replays printed nothing
        if bs not in args.batch_sizes or context not in args.contexts:
            parser.error(f"--profile {bs} {context}: this run replays batch sizes "
                         f"{args.batch_sizes} at contexts {args.contexts}; profile one of "
                         "those or add it with --batch-sizes / --contexts")
    if not torch.cuda.is_available():
        print("no GPU: the tiny CPU case (2 layers, bs 1 and 2, context 16, torch and triton "
              "kernels); --layers, --contexts, --batch-sizes and --backends apply on a GPU",
              flush=True)
        rows = run_base_step(torch.device("cpu"), torch.float32, preset="tiny", layers=2,
                             batch_sizes=(1, 2), contexts=(16,), reps=2)
    else:
        rows = run_base_step(torch.device("cuda"), torch.bfloat16, layers=args.layers,
                             batch_sizes=tuple(args.batch_sizes), contexts=tuple(args.contexts),
                             profile=[tuple(p) for p in args.profile],
                             backends=tuple(args.backends))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
