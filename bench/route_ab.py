"""``python -m bench.route_ab``: an A/B of capture-time routes in one process. Each variant
sets knobs of ``kernels.config`` (and ``SIDE_STREAM``, the fork beside the GEMM) for its own
runtime, captures that runtime's graphs, checks its LoRA replay against its eager forward, and
the variants' LoRA and base replays are then timed round by round, interleaved, so a slow
stretch of the device (clocks, power) falls on every variant alike. The figure is the median
of the rounds' LoRA-minus-base replay times.

    python -m bench.route_ab --step prefill --layers 4 --context 256 --adapters 16 \\
        --bs 1,4,8 --variant old:WIDE_BLOCKS_MIN_ROWS=1e9 --variant new

A variant is ``NAME`` or ``NAME:KNOB=VALUE,...``; ``KNOB`` is an upper-case name of
``kernels.config`` (``GRAPH_WINDOWS_MIN_ROWS.rope=128`` for a key of a dict knob) or
``SIDE_STREAM``; ``VALUE`` a Python literal of the knob's type (``1e9`` is read as an int; a
bool knob takes 0 or 1, a tuple as many values). Each variant starts
from the defaults; they are restored on exit."""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import kernels.config as config
import kernels.expand
import kernels.shrink
import lora_runtime.lora.side_stream as side_stream
from bench.args import int_list, positive, torch_device, torch_dtype
from bench.kernel_diff import kernel_diff, per_kernel_us
from bench.logits_match import assert_logits_match
from bench.model_runtime import BenchRuntime
from bench.table import render
from bench.timing import CPU_NOTE, bench_time
from lora_runtime.lora.backends import BACKENDS
from lora_runtime.model.config import PRESETS

_CACHED = [f for module in (config, kernels.shrink, kernels.expand) for f in vars(module).values()
           if callable(getattr(f, "cache_clear", None))]
"""Launch shapes cached per tensor shape: they read knobs, so each variant starts them empty."""


@dataclass(frozen=True)
class Variant:
    name: str
    knobs: tuple[tuple[str, str | None, object], ...]
    """(knob, dict key or None, value)."""


def _variant_arg(spec: str) -> Variant:
    try:
        return parse_variant(spec)
    except (ValueError, SyntaxError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_variant(spec: str) -> Variant:
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"variant {spec!r}: give it a name (NAME or NAME:KNOB=VALUE,...)")
    if "=" in name:  # a knob setting without a name: it ran the defaults under this name
        raise ValueError(f"variant {spec!r}: a name has no '='; knobs follow the name and a "
                         f"colon: NAME:KNOB=VALUE,... (e.g. new:{spec})")
    knobs = []
    # Commas inside a value (a tuple) do not separate: only one before the next KNOB= does.
    for item in filter(None, re.split(r",\s*(?=[A-Z][A-Z0-9_]*(?:\.\w+)?=)", rest)):
        lhs, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {name!r}: {item!r} is not KNOB=VALUE")
        knob, _, key = lhs.partition(".")
        _check_knob(name, knob, key or None)
        if any((k, kk) == (knob, key or None) for k, kk, _ in knobs):  # the last one won
            raise ValueError(f"variant {name!r}: {lhs} is set twice; give each knob once")
        knobs.append((knob, key or None, _checked_value(name, lhs, knob, key or None,
                                                        _literal(value))))
    return Variant(name, tuple(knobs))


def _literal(text: str):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"{text!r} is not a Python literal (a number, a tuple, True)") from None
    if isinstance(value, tuple):  # (33, 1e9) as (33, 1000000000), as 1e9 alone
        return tuple(map(_integral, value))
    return _integral(value)


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _knob_names() -> list[str]:
    return sorted(n for n in vars(config) if n.isupper()) + ["SIDE_STREAM"]


def _check_knob(variant: str, knob: str, key: str | None) -> None:
    if knob not in _knob_names():
        raise ValueError(f"variant {variant!r}: unknown knob {knob!r}; knobs: "
                         f"{', '.join(_knob_names())}")
    current = _get(knob)
    if key is not None and not (isinstance(current, dict) and key in current):
        raise ValueError(f"variant {variant!r}: {knob} has no key {key!r}"
                         + (f" (keys: {', '.join(current)})" if isinstance(current, dict)
                            else f" (it is a {type(current).__name__}, not a dict)"))
    if key is None and isinstance(current, dict):
        raise ValueError(f"variant {variant!r}: {knob} is a dict; set one key: "
                         f"{knob}.{next(iter(current))}=VALUE")


def _checked_value(variant: str, lhs: str, knob: str, key: str | None, value):
    """``value`` if it has the default's type (a bool knob takes 0 or 1, a tuple as many
    values of the same types): the knobs are read deep inside a capture, where a str or a
    tuple for an int was a TypeError after every variant's runtime was built."""
    current = _get(knob) if key is None else _get(knob)[key]
    want = type(current)
    if want is bool:
        ok = isinstance(value, bool) or (type(value) is int and value in (0, 1))
    else:
        ok = type(value) is want
    if not ok:
        raise ValueError(f"variant {variant!r}: {lhs}={value!r} is of type "
                         f"{type(value).__name__}; it takes type {want.__name__} (default "
                         f"{current!r})")
    if want is tuple and [type(v) for v in value] != [type(v) for v in current]:
        types = ", ".join(type(v).__name__ for v in current)
        raise ValueError(f"variant {variant!r}: {lhs}={value!r}: it takes {len(current)} "
                         f"values of type {types} like its default {current!r}")
    problem = config.KNOB_PROBLEMS.get(knob, lambda v: None)(value)
    if problem:  # a value the kernels cannot compile: it failed on the GPU, in ptxas
        raise ValueError(f"variant {variant!r}: {lhs}={value!r}: {problem}")
    return value


def _get(knob: str):
    return side_stream.ENABLED if knob == "SIDE_STREAM" else getattr(config, knob)


def _set(knob: str, value) -> None:
    if knob == "SIDE_STREAM":
        side_stream.ENABLED = bool(value)
    else:
        setattr(config, knob, value)


@contextmanager
def knobs_of(variant: Variant):
    """The variant's knobs over the defaults; every knob it touched restored after."""
    saved = {k: _get(k) for k, _, _ in variant.knobs}
    try:
        for knob, key, value in variant.knobs:
            _set(knob, {**_get(knob), key: value} if key is not None else value)
        for f in _CACHED:
            f.cache_clear()
        yield
    finally:
        for knob, value in saved.items():
            _set(knob, value)
        for f in _CACHED:
            f.cache_clear()


class _Prepared:
    """One variant's runtime, its batches per batch size and their replays."""

    def __init__(self, variant: Variant, args, device: torch.device) -> None:
        self.variant = variant
        with knobs_of(variant):
            self.rt = BenchRuntime(args.step, args.preset, args.layers, args.context,
                                   args.adapters, tuple(args.rank), args.backend, args.dtype,
                                   args.bs, device, live_requests=sum(args.bs))
            self.batches = {bs: (self.rt.batch(bs, "lora", seed=bs)[0],
                                 self.rt.batch(bs, "base", seed=bs)[0]) for bs in args.bs}
            self.errors = {bs: self._verify(lb, args) for bs, (lb, _) in self.batches.items()}

    def _verify(self, batch, args) -> float:
        eager = self.rt.eager(batch).clone()
        return assert_logits_match(self.rt.step(batch), eager, args.dtype,
                                   f"variant {self.variant.name}: the LoRA graph replay differs "
                                   "from the eager forward", args.layers)

    def kernels(self, bs: int, reps: int, top: int) -> list[dict]:
        """LoRA's replay against base's, kernel by kernel (``bench.kernel_diff``)."""
        lb, bb = self.batches[bs]
        with knobs_of(self.variant):
            cuda = self.rt.device.type == "cuda"
            lora = per_kernel_us(self.rt.replay_only(lb), reps, cuda)
            base = per_kernel_us(self.rt.replay_only(bb), reps, cuda)
        return kernel_diff(lora, base, top)

    def time(self, batch, reps: int) -> float:
        """Microseconds a replay of ``batch``'s graph (its static buffers refreshed first):
        the median of ``reps`` replays."""
        return bench_time(self.rt.replay_only(batch), device=self.rt.device, mode="events",
                          warmup=1, reps=reps).median_us


def run(args) -> list[dict]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prepared = []
    for v in args.variants:
        try:
            prepared.append(_Prepared(v, args, device))
        except torch.OutOfMemoryError as e:
            raise SystemExit(
                f"route_ab: variant {v.name!r} ({len(prepared)} runtimes already built) does not "
                f"fit in device memory: each variant holds its own model ({args.layers} layers) "
                f"and a KV cache for every batch size ({sum(args.bs)} requests of each traffic)."
                f" Pass fewer variants, fewer --layers or smaller --bs. ({e})") from None
    samples = {(p.variant.name, bs): ([], []) for p in prepared for bs in args.bs}
    for round_ in range(args.rounds):
        for bs in args.bs:
            for p in prepared:
                lb, bb = p.batches[bs]
                lora, base = samples[p.variant.name, bs]
                with knobs_of(p.variant):  # a step's host side reads knobs too
                    lora.append(p.time(lb, args.reps))
                    base.append(p.time(bb, args.reps))
                # stderr, as it comes: a run cut short (a time limit) still tells its rounds
                print(f"round {round_ + 1}/{args.rounds} bs {bs} {p.variant.name}: LoRA "
                      f"{lora[-1]:.1f} us, base {base[-1]:.1f} us", file=sys.stderr, flush=True)
    rows = []
    for bs in args.bs:
        for p in prepared:
            lora, base = samples[p.variant.name, bs]
            added = [a - b for a, b in zip(lora, base, strict=True)]
            rows.append({"variant": p.variant.name, "knobs": [list(k) for k in p.variant.knobs],
                         "step": args.step, "bs": bs, "layers": args.layers,
                         "adapters": args.adapters, "rank": args.rank,
                         "lora_us": statistics.median(lora), "base_us": statistics.median(base),
                         "added_us": statistics.median(added),
                         "added_pct": 100 * statistics.median(added) / statistics.median(base),
                         "added_us_rounds": added, "max_rel_err_vs_eager": p.errors[bs]})
            if args.kernels:
                rows[-1]["kernel_diff"] = p.kernels(bs, args.reps, args.kernels)
    return rows


def table(rows: list[dict]) -> str:
    head = ["bs", "variant", "LoRA replay us", "base replay us", "LoRA adds us (rounds)",
            "adds % of base"]
    body = [[str(r["bs"]), r["variant"], f"{r['lora_us']:.1f}", f"{r['base_us']:.1f}",
             f"{r['added_us']:.1f} ({min(r['added_us_rounds']):.1f}-"
             f"{max(r['added_us_rounds']):.1f})", f"{r['added_pct']:.1f}%"] for r in rows]
    text = render(head, body)
    for r in rows:
        if "kernel_diff" in r:
            text += (f"\n\nbs {r['bs']} {r['variant']}: LoRA replay minus base replay by kernel "
                     "(us a replay; launches a replay)\n")
            text += render(["kernel", "LoRA - base", "LoRA", "base"],
                           [[d["name"], f"{d['diff_us']:+.1f}",
                             f"{d['a_us']:.1f} ({d['a_launches']:g})",
                             f"{d['b_us']:.1f} ({d['b_launches']:g})"]
                            for d in r["kernel_diff"]])
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.route_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=["decode", "prefill"], default="decode")
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--context", type=positive, default=256)
    p.add_argument("--adapters", type=positive, default=16)
    p.add_argument("--rank", type=int_list("/"), default=[16],
                   help="ranks, adapter i gets rank i mod len (8/16/64)")
    p.add_argument("--bs", type=int_list(","), default=[16],
                   help="batch sizes (prefill: requests of --context tokens)")
    p.add_argument("--variant", dest="variants", action="append", type=_variant_arg,
                   required=True, help="NAME or NAME:KNOB=VALUE,... (repeat to compare)")
    p.add_argument("--backend", default="triton", choices=sorted(BACKENDS))
    p.add_argument("--dtype", type=torch_dtype, default=None,
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--device", type=torch_device, default=None)
    p.add_argument("--rounds", type=positive, default=6)
    p.add_argument("--reps", type=positive, default=20, help="replays a timing")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile each variant's replays and list the N kernels whose "
                   "time LoRA changes most (CPU: ops)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    args = p.parse_args(argv)
    twice = sorted({b for b in args.bs if args.bs.count(b) > 1})
    if twice:  # one batch per size: its rows printed twice, each with twice the rounds
        p.error(f"--bs {','.join(map(str, args.bs))}: batch size {twice[0]} is given twice")
    if args.kernels < 0:
        p.error(f"--kernels {args.kernels}: give a count >= 0")
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        p.error(f"variant names repeat: {names}")
    if args.dtype is None:
        args.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu":
        print(CPU_NOTE, file=sys.stderr)  # stdout may be --json lines
    rows = run(args)
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
