"""Tuning sweep for one kernel case: times every combination of launch overrides.

    python -m bench.sweep --module gate_up_proj --tokens 2048 --adapters 1 --rank 64 \\
        --kernel expand --grid block_n=64,128,256 tiles=1,4 num_warps=4,8

``--once`` runs each variant a single time instead (for ``ncu``/``nsys``, which time it).
"""

from __future__ import annotations

import argparse
import inspect
import itertools

import torch

import kernels  # noqa: F401
from bench import hardware, kernel_bench
from bench.args import positive
from bench.timing import bench_time
from kernels import SegmentLayout, lora_expand, lora_shrink, plan_segments
from lora_runtime.model.config import PRESETS


def _overrides(launch) -> tuple[str, ...]:
    names = list(inspect.signature(launch).parameters)
    return tuple(names[names.index("layout") + 1:])


OVERRIDES = {"shrink": _overrides(lora_shrink), "expand": _overrides(lora_expand)}
"""The launch overrides each kernel's launcher takes (its keyword arguments after
``layout``), read from the launchers so the two cannot drift apart."""


POWERS_OF_TWO = ("block_n", "block_k", "num_warps")
"""Overrides Triton takes as powers of two only (a block is a ``tl.arange``): any other value
was a traceback from the first launch."""


def parse_grid(p: argparse.ArgumentParser, grid: list[str], kernel: str):
    """``name=v1,v2`` items -> (names, value lists); a bad item is a usage error naming it."""
    names, values = [], []
    for item in grid:
        name, eq, text = item.partition("=")
        if not eq or not text:
            p.error(f"--grid {item!r}: give name=v1,v2,... (names for --kernel {kernel}: "
                    f"{', '.join(OVERRIDES[kernel])})")
        if name not in OVERRIDES[kernel]:
            p.error(f"--grid {item!r}: {name!r} is not a launch override of --kernel {kernel}; "
                    f"choose from {', '.join(OVERRIDES[kernel])}")
        try:
            vals = [None if v == "auto" else int(v) for v in text.split(",")]
        except ValueError:
            p.error(f"--grid {item!r}: values are integers or auto")
        if any(v is not None and v < 1 for v in vals):
            p.error(f"--grid {item!r}: values must be >= 1 (or auto)")
        if name in names:  # zip() into the launch's kwargs kept only the last list
            p.error(f"--grid {item!r}: {name} is already in the grid; give all its values in "
                    f"one item ({name}=v1,v2,...)")
        if name in POWERS_OF_TWO and any(v is not None and v & (v - 1) for v in vals):
            p.error(f"--grid {item!r}: {name} values must be powers of 2 (or auto)")
        names.append(name)
        values.append(vals)
    return names, values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--module", required=True)
    p.add_argument("--tokens", type=positive, required=True)
    p.add_argument("--adapters", type=positive, default=1)
    p.add_argument("--rank", type=positive, default=16)
    p.add_argument("--kernel", choices=("shrink", "expand"), required=True)
    p.add_argument("--grid", nargs="*", default=[], help="name=v1,v2 ... (launch overrides)")
    p.add_argument("--once", action="store_true")
    args = p.parse_args(argv)
    try:
        PRESETS[args.preset]().module_shape(args.module)
    except KeyError as e:
        p.error(f"--module: {e.args[0]}")
    if args.adapters > args.tokens:  # prefill: all tokens in one adapter's request, floors
        # counting every adapter's weights; decode: only --tokens adapters used
        p.error(f"--adapters {args.adapters} is more than --tokens {args.tokens}: a kernel case "
                "has at most one adapter per token (as the suite's cases); give --adapters <= "
                "--tokens")
    names, values = parse_grid(p, args.grid, args.kernel)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = kernel_bench.KernelCase(args.preset, args.module, args.tokens, args.adapters,
                                   args.rank, dtype)
    slots, lens = case.token_slots()
    layout = SegmentLayout.from_plan(plan_segments(slots, lens, block_m=case.block_m), device)
    ceil = hardware.measure(device, dtype) if not args.once else None
    nbytes = kernel_bench.floors(case)[args.kernel][0]
    copies = 1 if args.once else kernel_bench.copies_for(nbytes, ceil.l2_bytes, device)
    ws = [kernel_bench.make_weights(case, device) for _ in range(copies)]
    xs = [torch.randn(case.tokens, case.shape.in_features, dtype=dtype, device=device)
          for _ in ws]
    ys = [torch.randn(case.tokens, case.shape.out_features, dtype=dtype, device=device)
          for _ in ws]
    shrunk = [lora_shrink(x, w, layout) for x, w in zip(xs, ws, strict=True)]
    rows = []
    for combo in itertools.product(*values) if values else [()]:
        kw = dict(zip(names, combo, strict=True))
        if args.kernel == "shrink":
            fn = lambda kw=kw: [lora_shrink(x, w, layout, **kw)
                                for x, w in zip(xs, ws, strict=True)]
        else:
            fn = lambda kw=kw: [lora_expand(a, w, y, layout, **kw)
                                for a, w, y in zip(shrunk, ws, ys, strict=True)]
        if args.once:
            fn()
            continue
        t = bench_time(fn, device=device, calls=copies, reps=20)
        rows.append((t.median_us, kw))
        print(f"{t.median_us:9.2f} us  {nbytes / t.median_us / 1e3:7.0f} GB/s  {kw}", flush=True)
    if rows:
        best = min(rows, key=lambda r: r[0])
        print(f"best: {best[0]:.2f} us {best[1]}  ({case})")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
