"""``python -m bench``: runs the suites of the chosen profile, prints tables, writes results/.

Profiles: ``gpu`` (Llama-3-8B shapes, bf16, CUDA-graph timing) and ``cpu`` (tiny shapes, fp32,
Triton interpreter, wall clock: proves the pipeline end to end, its times mean nothing).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

import kernels  # noqa: F401  (selects the Triton interpreter on CPU before kernels load)
from bench import hardware, kernel_bench, model_bench, provenance, results, table
from lora_runtime.model import config as model_config

KERNEL_KEY = ("suite", "module", "tokens", "adapters", "rank", "dtype", "provider")
MODEL_KEY = ("suite", "kind", "preset", "layers", "batch_size", "runtime", "traffic", "path",
             "backend", "dtype")

PROFILES = {
    "gpu": dict(
        preset="llama3-8b", dtype=torch.bfloat16, reps=30,
        modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        tokens=(1, 16, 64, 256, 2048), adapters=(1, 4, 16), ranks=(16, 64),
        models=[
            model_bench.ModelCase("tiny", 2, (1, 8, 32), 64, 4, 16, "triton", torch.bfloat16),
            model_bench.ModelCase("llama3-8b", 4, (1, 8, 32, 64), 256, 4, 16, "triton",
                                  torch.bfloat16),
        ],
    ),
    "gpu-quick": dict(
        preset="llama3-8b", dtype=torch.bfloat16, reps=20,
        modules=("qkv_proj", "gate_up_proj", "down_proj"),
        tokens=(1, 64, 2048), adapters=(1, 8), ranks=(16,),
        models=[model_bench.ModelCase("llama3-8b", 2, (1, 32), 128, 4, 16, "triton",
                                      torch.bfloat16)],
    ),
    "cpu": dict(
        preset="tiny", dtype=torch.float32, reps=3,
        modules=("qkv_proj", "down_proj"), tokens=(1, 16), adapters=(1, 4), ranks=(8,),
        models=[model_bench.ModelCase("tiny", 2, (1, 4), 16, 2, 8, "torch", torch.float32)],
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("kernels", "model", "all"), default="all")
    p.add_argument("--profile", choices=("auto", *PROFILES), default="auto",
                   help="auto: gpu when CUDA is available, else cpu")
    p.add_argument("--filter", default="",
                   help="regex on 'module T=<tokens> adapters=<n> r=<rank>' to run a subset")
    p.add_argument("--out", type=Path, default=provenance.ROOT / "results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.profile if args.profile != "auto" else ("gpu" if device.type == "cuda" else "cpu")
    if name.startswith("gpu") and device.type != "cuda":
        raise SystemExit(f"profile {name!r} needs a CUDA device; use --profile cpu")
    prof = PROFILES[name]
    run = provenance.collect(device) | {"profile": name}
    ceil = hardware.measure(device, prof["dtype"])
    run["ceilings"] = ceil.as_dict()
    print(f"device: {ceil.device_name}  copy {ceil.copy_gbps:.0f} GB/s  "
          f"matmul {ceil.matmul_tflops:.1f} TFLOP/s  profile {name}")
    slug = re.sub(r"[^a-z0-9]+", "-", run["device"].lower()).strip("-")
    if args.suite in ("kernels", "all"):
        run_kernels(prof, args, device, ceil, run, args.out / f"kernels-{slug}.json")
    if args.suite in ("model", "all"):
        run_models(prof, args, device, ceil, run, args.out / f"model-{slug}.json")
    return 0


def run_kernels(prof, args, device, ceil, run, path) -> None:
    cfg = model_config.PRESETS[prof["preset"]]()
    todo = kernel_bench.cases(cfg, prof["modules"], prof["tokens"], prof["adapters"],
                              prof["ranks"], prof["dtype"])
    pattern = re.compile(args.filter)
    todo = [c for c in todo
            if pattern.search(f"{c.shape.name} T={c.tokens} adapters={c.adapters} r={c.rank}")]
    rows = []
    for i, case in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {case.shape.name} T={case.tokens} "
              f"adapters={case.adapters} r={case.rank}", flush=True)
        new = kernel_bench.run_case(case, device, ceil, prof["reps"])
        # Written case by case: a run cut short keeps what it measured.
        results.upsert(path, run, new, key=KERNEL_KEY)
        rows += new
    print(table.kernel_table(rows))
    print(f"wrote {len(rows)} rows to {path}")


def run_models(prof, args, device, ceil, run, path) -> None:
    rows = []
    for case in prof["models"]:
        print(f"[model] {case.preset} layers={case.layers} batch sizes={case.batch_sizes} "
              f"context={case.context} adapters={case.adapters} r={case.rank}", flush=True)
        new = model_bench.run_model_case(case, device, ceil, prof["reps"])
        results.upsert(path, run, new, key=MODEL_KEY)
        rows += new
    print(table.model_table(rows))
    print(f"wrote {len(rows)} rows to {path}")
