"""Attention over the token-slot KV cache, per regime, next to its floor: decode at several
batch sizes and contexts, prefill with a growing number of requests at a fixed length (and a
chunked-prefill case: new tokens after a cached prefix), the Triton kernels and the torch
reference. Also the whole base decode step (replay only) with either attention.

Floors: bytes (K/V of every context read once, q read and out written once) over the copy
bandwidth measured in the same run; prefill also has a FLOP floor (causal QK^T and PV) over
the measured matmul rate; ``x_floor`` is time over the larger. Small cases rotate over
distinct KV caches (one per "layer") so the timing does not measure the L2.

``python -m bench.attention_bench [--quick]`` prints a table (GPU: Llama-3-8B heads, bf16).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.args import check_out_file, positive
from bench.case import Case
from bench.hardware import Ceilings, measure
from bench.timing import Timing, bench_time
from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from lora_runtime.engine.forward_batch import DecodeAttention, ExtendAttention
from lora_runtime.model.attention_ops import decode_attention_reference, extend_attention_reference

L2_SWEEP_BYTES = 256 * 2**20
TORCH_REF_MAX_BYTES = 2 * 2**30  # the reference's gathered copy (decode) or dense mask scores


@dataclass(frozen=True)
class AttentionCase(Case):
    suite = "attention"
    regime: str
    """"decode" or "prefill"."""
    requests: int
    length: int
    """decode: keys per request; prefill: new tokens per request."""
    prefix: int = 0
    """prefill: cached tokens before the new ones."""
    provider: str = "triton"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    tiles: tuple[int, ...] | None = None
    """Triton launch override (decode: block_n, warps, stages; prefill: block_m, block_n,
    warps, stages); None: the kernel's default."""
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        extra = f" prefix={self.prefix}" if self.prefix else ""
        extra += f" tiles={','.join(map(str, self.tiles))}" if self.tiles else ""
        return f"attention {self.regime} reqs={self.requests} len={self.length}{extra} " \
               f"{self.provider} {self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tokens(self) -> int:
        return self.requests * (1 if self.regime == "decode" else self.length)

    @property
    def context(self) -> int:
        return self.length + self.prefix

    def bytes_floor(self, elt: int) -> int:
        kv = self.requests * self.context * self.kv_heads * self.head_dim * 2 * elt
        return kv + 2 * self.tokens * self.heads * self.head_dim * elt

    def flops(self) -> int:
        if self.regime == "decode":
            pairs = self.requests * self.context
        else:  # row j of a request sees prefix + j + 1 keys
            m = self.length
            pairs = self.requests * (m * self.prefix + m * (m + 1) // 2)
        return 4 * pairs * self.heads * self.head_dim


def default_cases(quick: bool, gpu: bool, dtype: str) -> list[AttentionCase]:
    shape = {"dtype": dtype} | ({} if gpu else {"heads": 4, "kv_heads": 2, "head_dim": 16})
    if not gpu:
        decode = [(bs, ctx) for bs in (1, 4) for ctx in (64, 160)]
        prefill = [(n, 32, 0) for n in (1, 2, 4)] + [(2, 16, 48)]
    elif quick:
        decode = [(bs, ctx) for bs in (1, 64) for ctx in (512, 4096)]
        prefill = [(n, 1024, 0) for n in (1, 4, 16)]
    else:
        decode = [(bs, ctx) for bs in (1, 8, 64, 256) for ctx in (512, 1024, 2048, 4096)]
        prefill = [(n, 1024, 0) for n in (1, 2, 4, 8, 16)] + [(4, 512, 2048), (16, 512, 2048)]
    cases = []
    for provider in ("triton", "torch"):
        cases += [AttentionCase("decode", bs, ctx, 0, provider, **shape) for bs, ctx in decode]
        cases += [AttentionCase("prefill", n, m, p, provider, **shape) for n, m, p in prefill]
    return cases


class _Inputs:
    """One "layer" copy: its own caches, queries and metadata; contexts in contiguous slots."""

    def __init__(self, case: AttentionCase, dtype, device, g: torch.Generator) -> None:
        c = case.context
        slots = case.requests * c + 1
        rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype, device=device)  # noqa: E731
        self.k = rnd(slots, case.kv_heads, case.head_dim)
        self.v = rnd(slots, case.kv_heads, case.head_dim)
        self.q = rnd(case.tokens, case.heads, case.head_dim)
        long = dict(dtype=torch.long, device=device)
        table = torch.arange(1, slots, **long).view(case.requests, c)
        if case.regime == "decode":
            self.decode = DecodeAttention(table, torch.full((case.requests,), c, **long))
            return
        m, p, n = case.length, case.prefix, case.requests
        req = torch.arange(n, **long)
        pos = torch.arange(c, **long)
        self.positions = (p + torch.arange(m, **long)).repeat(n)
        int32 = dict(dtype=torch.int32, device=device)
        self.extend = ExtendAttention(
            req.repeat_interleave(m), table.reshape(-1), req.repeat_interleave(c), pos.repeat(n),
            torch.arange(n + 1, **int32) * m, torch.arange(n + 1, **int32) * c)

    def run(self, case: AttentionCase, provider: str) -> torch.Tensor:
        scale = case.head_dim**-0.5
        if case.regime == "decode":
            if provider == "triton":
                return decode_attention(self.q, self.k, self.v, self.decode.kv_indices,
                                        self.decode.kv_lens, scale, tiles=case.tiles)
            return decode_attention_reference(self.q, self.k, self.v, self.decode, scale)
        if provider == "triton":
            return extend_attention(self.q, self.k, self.v, self.extend.kv_indices,
                                    self.extend.q_starts, self.extend.kv_starts, scale,
                                    case.tiles)
        return extend_attention_reference(self.q, self.k, self.v, self.extend, self.positions,
                                          scale)


def _request_error(case: AttentionCase, inp: _Inputs, out: torch.Tensor, i: int = 0) -> float:
    """Relative error of request ``i`` against the torch reference run in fp32 on it alone."""
    one = AttentionCase(case.regime, 1, case.length, case.prefix, "torch", case.heads,
                        case.kv_heads, case.head_dim, dtype="float32")
    ref_in = _Inputs.__new__(_Inputs)
    ref_in.k, ref_in.v = inp.k.float(), inp.v.float()
    rows = case.tokens // case.requests
    q0 = i * rows
    ref_in.q = inp.q[q0 : q0 + rows].float()
    if case.regime == "decode":
        ref_in.decode = DecodeAttention(inp.decode.kv_indices[i : i + 1],
                                        inp.decode.kv_lens[i : i + 1])
    else:
        e, c = inp.extend, case.context
        ref_in.positions = inp.positions[q0 : q0 + rows]
        k0 = int(e.kv_starts[i])
        ref_in.extend = ExtendAttention(e.token_req[q0 : q0 + rows] - i,
                                        e.kv_indices[k0 : k0 + c], e.kv_req[k0 : k0 + c] - i,
                                        e.kv_pos[k0 : k0 + c], e.q_starts[:2], e.kv_starts[:2])
    ref = ref_in.run(one, "torch").double()
    got = out[q0 : q0 + rows].double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def checked_requests(case: AttentionCase) -> list[int]:
    """The first, a middle and the last request: a fault at a request boundary (an index
    offset for request b > 0, a length read from another request) spares request 0."""
    return sorted({0, case.requests // 2, case.requests - 1})


def _torch_ref_bytes(case: AttentionCase, elt: int) -> int:
    """The reference's largest temporary: the gathered K/V (decode) or the dense mask."""
    if case.regime == "decode":
        return case.requests * case.context * case.kv_heads * case.head_dim * 2 * elt
    return case.tokens * case.requests * case.context // 4


def torch_reference_too_large(case: AttentionCase) -> bool:
    elt = torch.tensor([], dtype=case.torch_dtype).element_size()
    return case.provider == "torch" and _torch_ref_bytes(case, elt) > TORCH_REF_MAX_BYTES


def measure_case(case: AttentionCase, device: torch.device, ceil: Ceilings,
                 reps: int = 30) -> tuple[Timing, dict]:
    """Correctness first (the first, a middle and the last request vs the fp32 reference;
    ``AssertionError`` naming the case and request when off), then the time and the figures
    against the floors."""
    dtype = case.torch_dtype
    elt = torch.tensor([], dtype=dtype).element_size()
    bytes_floor = case.bytes_floor(elt)
    copies = max(1, min(64, -(-L2_SWEEP_BYTES // bytes_floor))) if device.type == "cuda" else 1
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [_Inputs(case, dtype, device, g) for _ in range(copies)]
    out = inputs[0].run(case, case.provider)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    err = 0.0
    for i in checked_requests(case):
        e = _request_error(case, inputs[0], out, i)
        if not e < tol:
            raise AssertionError(f"{case.label}: request {i}: relative error {e:.2e} vs the "
                                 f"fp32 reference (limit {tol})")
        err = max(err, e)

    def sweep() -> None:
        for inp in inputs:
            inp.run(case, case.provider)

    t = bench_time(sweep, device=device, mode="graph", calls=copies, reps=reps)
    floor_us = max(bytes_floor / (ceil.copy_gbps * 1e3),
                   case.flops() / (ceil.matmul_tflops * 1e6))
    return t, {
        "rel_err": err, "copies": copies, "bytes_floor": bytes_floor, "flops": case.flops(),
        "floor_us": floor_us, "x_floor": t.median_us / floor_us,
        "copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops,
        "gbps": bytes_floor / (t.median_us * 1e3),
    }


def run_attention_case(case: AttentionCase, device: torch.device, ceil: Ceilings,
                       reps: int = 30) -> dict:
    """One flat row (``--json``): correctness first, then the time."""
    row = {"suite": "attention", "case": case.label, "regime": case.regime,
           "requests": case.requests, "length": case.length, "prefix": case.prefix,
           "provider": case.provider, "tiles": case.tiles, "heads": case.heads,
           "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dtype": case.dtype}
    if torch_reference_too_large(case):
        return row | {"skipped": "torch reference over 2 GB"}
    t, derived = measure_case(case, device, ceil, reps)
    return row | _stats(t) | derived


def sweep_cases(dtype: str) -> list[AttentionCase]:
    """Launch variants on a few cases per regime (GPU)."""
    decode = [(32, 4, 3), (128, 4, 2), (64, 8, 3)]
    prefill = [(128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 3)]
    cases = [AttentionCase("decode", bs, ctx, tiles=t, dtype=dtype)
             for bs, ctx in ((1, 4096), (64, 2048)) for t in decode]
    return cases + [AttentionCase("prefill", 16, 1024, tiles=t, dtype=dtype) for t in prefill]


def _stats(t) -> dict:
    return {"median_us": t.median_us, "p20_us": t.quantile(0.2), "p80_us": t.quantile(0.8),
            "samples": len(t.samples_us), "timing_mode": t.mode}


def run_attention_suite(device: torch.device, dtype: torch.dtype, quick: bool = False,
                        reps: int = 30, ceil: Ceilings | None = None,
                        cases: list[AttentionCase] | None = None, on_row=None) -> list[dict]:
    """Rows of ``cases`` (default: ``default_cases``); ``on_row`` sees each as it is made."""
    ceil = ceil or measure(device, dtype)
    name = str(dtype).removeprefix("torch.")
    rows = []
    for case in cases or default_cases(quick, device.type == "cuda", name):
        rows.append(run_attention_case(case, device, ceil, reps))
        if on_row is not None:
            on_row(rows[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


TABLE_HEAD = ("| regime | reqs | len | prefix | provider | us | floor us | x floor | GB/s | err |\n"
              "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|")


def format_row(r: dict) -> str:
    prov = r["provider"] + (f" {r['tiles']}" if r.get("tiles") else "")
    head = f"| {r['regime']} | {r['requests']} | {r['length']} | {r['prefix']} | {prov} | "
    if "median_us" not in r:
        return head + f"{r.get('skipped', '-')} | | | | |"
    return head + (f"{r['median_us']:.1f} | {r['floor_us']:.1f} | {r['x_floor']:.2f} | "
                   f"{r['gbps']:.0f} | {r['rel_err']:.1e} |")


def format_table(rows: list[dict]) -> str:
    return "\n".join([TABLE_HEAD] + [format_row(r) for r in rows])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few cases per regime")
    parser.add_argument("--sweep", action="store_true", help="launch variants (GPU)")
    parser.add_argument("--reps", type=positive, default=30)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.json:
        check_out_file(parser, "--json", args.json)
    if args.sweep and args.quick:  # the sweep's cases were run, --quick said nothing
        parser.error("--sweep runs its own cases (launch variants): drop --quick")
    if args.sweep and not torch.cuda.is_available():  # Llama-3-8B heads in the interpreter
        parser.error("--sweep times launch variants of Llama-3-8B-sized cases on a GPU; "
                     "without one they run in the Triton interpreter for hours and its times "
                     "say nothing of a launch: run it on a GPU")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    print(TABLE_HEAD, flush=True)
    rows = run_attention_suite(device, dtype, args.quick, args.reps,
                               cases=sweep_cases(str(dtype).removeprefix("torch."))
                               if args.sweep else None,
                               on_row=lambda r: print(format_row(r), flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
