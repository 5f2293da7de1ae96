"""LoRA kernels per module shape: this project's Triton kernels vs the torch reference vs the
module's base GEMM, each timed inside a CUDA graph over enough distinct weight copies that
they do not sit in L2, and each next to its bytes/FLOP floor. A case is first checked
against an fp32 computation; a case that fails the check is reported as failed, not timed.

Rows: one per provider (``triton``, ``triton_shrink``, ``triton_expand``, ``torch``, ``base``,
and the whole module, base GEMM plus LoRA in one graph: ``module`` as the runtime schedules
it (``lora_runtime.lora.linear_schedule``: the shrink beside the GEMM), ``module_serial`` in
one stream), and eagerly (``module_eager``: a lone LoRA layer's eager route, against
``base_eager``, the GEMM alone; host time included); derived:
``x_floor``, ``achieved_gbps``, ``pct_of_base``, ``base_us``, the floors, ``copies``, and on
module rows ``lora_added_pct``: what LoRA adds to the module's time, as a share of the GEMM's
(eager: of the eager GEMM's, rep by rep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from bench.case import Case
from bench.context import Context
from bench.lora_check import lora_delta_fp32, row_errors
from bench.results import make_row
from bench.timing import Timing, bench_interleaved, bench_time, pair_ratio
from kernels import (
    LoRAWeights,
    SegmentLayout,
    SegmentSpec,
    lora_expand,
    lora_shrink,
    plan_segments,
)
from kernels.reference import expand_reference, shrink_reference
from lora_runtime.lora.backends import TritonBackend
from lora_runtime.lora.batch_info import LoRABatchPlan
from lora_runtime.lora.linear_schedule import lora_linear
from lora_runtime.model.config import PRESETS, ModuleShape
from lora_runtime.nvtx import nvtx_range

TORCH_GATHER_LIMIT = 2 * 2**30  # the reference gathers weights per row; beyond this, skip it
EAGER_COPIES = 8
"""Weight copies an eager timing cycles through: enough that the GEMM's weights leave L2
where the device time counts (many rows); eager calls of few rows are host-bound."""
CHECK_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class KernelCase(Case):
    suite = "kernels"
    preset: str
    module: str
    tokens: int
    adapters: int
    rank: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"kernels {self.module} T={self.tokens} adapters={self.adapters} r={self.rank}"

    @cached_property
    def shape(self) -> ModuleShape:
        return PRESETS[self.preset]().module_shape(self.module)

    @property
    def regime(self) -> str:
        return "decode" if self.tokens <= 256 else "prefill"

    @property
    def block_m(self) -> int:
        return 16 if self.regime == "decode" else 64

    @property
    def used_adapters(self) -> int:
        return min(self.adapters, self.tokens)

    def token_slots(self) -> tuple[list[int], list[int] | None]:
        """Decode: tokens interleaved over adapters (rows must be permuted to group them).
        Prefill: one request per adapter, contiguous."""
        if self.regime == "decode":
            return [t % self.adapters for t in range(self.tokens)], None
        lens = [self.tokens // self.adapters] * self.adapters
        lens[-1] += self.tokens - sum(lens)
        return list(range(self.adapters)), lens


def cases(preset: str, modules, tokens, adapters, ranks, dtype) -> list[KernelCase]:
    """The sweep, without cases with more adapters than tokens (they time the same launches
    as ``adapters == tokens``)."""
    return [
        KernelCase(preset, m, t, a, r, dtype)
        for m in modules for t in tokens for a in adapters for r in ranks if a <= t
    ]


def _elt(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def floors(case: KernelCase) -> dict[str, tuple[int, int]]:
    """(bytes, flops) lower bounds: each input read once, each output written once."""
    e, t, r = _elt(case.dtype), case.tokens, case.rank
    k, n, s = case.shape.in_features, case.shape.out_features, len(case.shape.slice_widths)
    used = case.used_adapters
    inter = t * s * r * 4  # the fp32 shrink output, written once and read once
    shrink = (t * k * e + used * s * r * k * e + inter, 2 * t * s * r * k)
    expand = (inter + used * n * r * e + 2 * t * n * e, 2 * t * n * r)
    lora = (shrink[0] + expand[0], shrink[1] + expand[1])
    base = (t * k * e + k * n * e + t * n * e, 2 * t * k * n)
    return {
        "shrink": shrink,
        "expand": expand,
        "lora": lora,
        "base": base,
        # GEMM and LoRA together read x once and write y once (base + lora counted x twice
        # and y three times: the expand's read and write of the GEMM's output).
        "module": (base[0] + lora[0] - t * k * e - 2 * t * n * e, base[1] + lora[1]),
    }


def copies_for(bytes_per_copy: int, l2_bytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return max(2, min(512, math.ceil(4 * l2_bytes / max(1, bytes_per_copy))))


def make_weights(case: KernelCase, device) -> LoRAWeights:
    w = LoRAWeights.for_linear(case.adapters, case.shape.in_features, case.shape.slice_widths,
                               case.rank, case.dtype, device)
    w.lora_a.normal_(0, case.shape.in_features**-0.5)
    w.lora_b.normal_(0, case.rank**-0.5)
    w.ranks[: case.adapters] = case.rank
    # A scaling of its own per slot and slice (timing does not depend on it): with one value
    # everywhere, a kernel reading another slot's or slice's scaling passed the check.
    slots = torch.arange(case.adapters, dtype=torch.float32, device=w.scalings.device)
    slices = torch.arange(w.num_slices, dtype=torch.float32, device=w.scalings.device)
    w.scalings[: case.adapters] = 2.0 * (1 + 0.5 * slots[:, None] / case.adapters
                                         + 0.125 * slices[None, :])  # 2.0 to 3.25
    return w


def run_case(case: KernelCase, ctx: Context) -> list[dict]:
    slots, lens = case.token_slots()
    plan = plan_segments(slots, lens, block_m=case.block_m)
    layout = SegmentLayout.from_plan(plan, ctx.device)
    try:
        provider = "triton"
        results, errors = _time_lora(case, layout, plan.token_slots, ctx)
        provider = "module"
        module, errors["module"] = _time_module(case, layout, plan.token_slots, ctx)
        results.update(module)
        provider = "module_eager"
        eager, errors["module_eager"] = _time_eager(case, plan.token_slots, ctx)
        results.update(eager)
    except VerificationError as e:
        return [make_row(case, ctx.profile, {"provider": provider},
                         verification={"status": "failed", "error": str(e)})]
    results["base"] = _time_base(case, ctx)
    base_us = results["base"][0].median_us
    fl = floors(case)
    rows = []
    for name, (timing, copies) in results.items():
        kind = {"triton_shrink": "shrink", "triton_expand": "expand", "base": "base",
                "module": "module", "module_serial": "module", "module_eager": "module",
                "base_eager": "base"}.get(name, "lora")
        nbytes, flops = fl[kind]
        ceil = ctx.ceilings
        floor_us = max(nbytes / (ceil.copy_gbps * 1e3), flops / (ceil.matmul_tflops * 1e6))
        med = timing.median_us
        derived = {
            "regime": case.regime, "copies": copies, "floor_bytes": nbytes, "floor_flops": flops,
            "floor_us": floor_us, "x_floor": med / floor_us if floor_us else None,
            "achieved_gbps": nbytes / (med * 1e3) if med else None,
            "base_us": base_us,
        }
        if name.endswith("_eager"):  # against the eager GEMM, rep by rep
            derived["base_us"] = results["base_eager"][0].median_us
            if kind == "module":
                ratio = pair_ratio(timing, results["base_eager"][0])
                derived["lora_added_pct"] = 100 * (ratio - 1)
        elif kind == "module":  # what LoRA adds to the GEMM, in one graph
            derived["lora_added_pct"] = 100 * (med - base_us) / base_us if base_us else None
        else:
            derived["pct_of_base"] = 100 * med / base_us if base_us else None
        ver = {"status": "verified", "error": None,
               "max_rel_err": errors.get(name, errors.get(name.split("_")[0])),
               "checks": ["shrink + expand == an fp32 reference (each slot and slice its own "
                          "scaling)"]}
        rows.append(make_row(case, ctx.profile, {"provider": name}, timing=timing,
                             derived=derived, verification=ver))
    return rows


class VerificationError(AssertionError):
    """A provider's LoRA output differs from the fp32 reference."""


def _time_lora(case, layout, token_slots, ctx):
    device, reps = ctx.device, ctx.reps
    k, n = case.shape.in_features, case.shape.out_features
    copies = copies_for(floors(case)["lora"][0], ctx.ceilings.l2_bytes, device)
    ws = [make_weights(case, device) for _ in range(copies)]
    xs = [torch.randn(case.tokens, k, dtype=case.dtype, device=device) for _ in ws]
    ys = [torch.randn(case.tokens, n, dtype=case.dtype, device=device) for _ in ws]
    errors = _check(case, ws[0], xs[0], layout, token_slots)
    shrunk = [lora_shrink(x, w, layout) for x, w in zip(xs, ws, strict=True)]
    each = list(zip(xs, ws, ys, shrunk, strict=True))
    timed = {
        "triton": lambda: [lora_expand(lora_shrink(x, w, layout), w, y, layout)
                           for x, w, y, _ in each],
        "triton_shrink": lambda: [lora_shrink(x, w, layout) for x, w, _, _ in each],
        "triton_expand": lambda: [lora_expand(a, w, y, layout) for _, w, y, a in each],
    }
    if _gather_bytes(case) <= TORCH_GATHER_LIMIT:
        timed["torch"] = lambda: [
            expand_reference(shrink_reference(x, w, layout), w, y, layout) for x, w, y, _ in each
        ]
    results = {}
    for name, fn in timed.items():
        with nvtx_range(f"{name} {case.label}"):
            results[name] = (bench_time(fn, device=device, calls=copies, reps=reps), copies)
    return results, errors


def _time_base(case, ctx):
    device, reps = ctx.device, ctx.reps
    k, n = case.shape.in_features, case.shape.out_features
    copies = copies_for(floors(case)["base"][0], ctx.ceilings.l2_bytes, device)
    each = [
        (torch.randn(case.tokens, k, dtype=case.dtype, device=device),
         torch.randn(n, k, dtype=case.dtype, device=device) * k**-0.5,
         torch.empty(case.tokens, n, dtype=case.dtype, device=device))
        for _ in range(copies)
    ]
    with nvtx_range(f"base {case.label}"):
        timing = bench_time(lambda: [torch.mm(x, w.t(), out=y) for x, w, y in each],
                            device=device, calls=copies, reps=reps)
    return timing, copies


def _time_module(case, layout, token_slots, ctx):
    """Base GEMM + LoRA per weight copy, as ``BaseBackend.linear`` runs it in a graph."""
    device, reps = ctx.device, ctx.reps
    k, n = case.shape.in_features, case.shape.out_features
    fl = floors(case)
    copies = copies_for(fl["base"][0] + fl["lora"][0], ctx.ceilings.l2_bytes, device)
    each = [
        (torch.randn(case.tokens, k, dtype=case.dtype, device=device),
         torch.randn(n, k, dtype=case.dtype, device=device) * k**-0.5,
         torch.empty(case.tokens, n, dtype=case.dtype, device=device),
         make_weights(case, device))
        for _ in range(copies)
    ]

    last = {}

    def module(schedule: str | None):
        for x, w, y, lw in each:
            last["y"] = lora_linear(
                lambda v, w=w, y=y: torch.mm(v, w.t(), out=y), x,
                lambda v, lw=lw: lora_shrink(v, lw, layout),
                lambda a, out, lw=lw: lora_expand(a, lw, out, layout), schedule)

    x, w, _, lw = each[-1]
    want = torch.mm(x, w.t()).float() + lora_delta_fp32(x, lw, token_slots)
    out, worst = {}, 0.0
    # module: as the runtime schedules it (schedule_for); the others force a schedule.
    for name, schedule in (("module", None), ("module_serial", "serial")):
        with nvtx_range(f"{name} {case.label}"):
            out[name] = (bench_time(lambda s=schedule: module(s), device=device, calls=copies,
                                    reps=reps), copies)
        # The graph's last replay left the last copy's base + LoRA in its output: a branch
        # joined too late shows up here.
        err = _worst_row_error(last["y"], want)
        if not err <= CHECK_TOL[case.dtype]:
            raise VerificationError(f"{case.label}: {name} output differs from base + LoRA "
                                    f"in fp32: a row's relative error {err:.3g}")
        worst = max(worst, err)
    return out, worst


def _time_eager(case, token_slots, ctx):
    """The module called eagerly as a lone LoRA layer runs it, ``LoRABackend.linear`` of a
    Triton backend prepared for the case's batch (the term in one launch after the GEMM where
    ``config.one_launch_lora`` allows, else shrink, GEMM and expand), and the GEMM alone
    (``F.linear``, as the runtime calls it), their calls alternating rep by rep: wall clock
    of each to the end of its device work, host time included (what an eager step pays).
    Per weight copy, ``EAGER_COPIES`` of them."""
    device, k, n = ctx.device, case.shape.in_features, case.shape.out_features
    fl = floors(case)
    copies = min(EAGER_COPIES, copies_for(fl["base"][0] + fl["lora"][0], ctx.ceilings.l2_bytes,
                                          device))
    each = [(torch.randn(case.tokens, k, dtype=case.dtype, device=device),
             torch.randn(n, k, dtype=case.dtype, device=device) * k**-0.5,
             make_weights(case, device)) for _ in range(copies)]
    slots, lens = case.token_slots()
    spec = SegmentSpec(tuple(slots), None if lens is None else tuple(lens), case.block_m, None)
    backend = TritonBackend(case.adapters, device)
    backend.prepare(LoRABatchPlan(spec, spec))
    last = {}

    def lora():
        for x, w, lw in each:
            last["y"] = backend.linear(lambda v, w=w: F.linear(v, w), x, lw)

    def base():
        for x, w, _ in each:
            F.linear(x, w)

    x, w, lw = each[-1]
    want = torch.mm(x, w.t()).float() + lora_delta_fp32(x, lw, token_slots)
    with nvtx_range(f"module_eager {case.label}"):
        t = bench_interleaved({"module_eager": lora, "base_eager": base}, device=device,
                              reps=ctx.reps, mode="latency")
    backend.reset_batch_state()
    err = _worst_row_error(last["y"], want)
    if not err <= CHECK_TOL[case.dtype]:
        raise VerificationError(f"{case.label}: module_eager output differs from base + LoRA "
                                f"in fp32: a row's relative error {err:.3g}")
    return {name: (Timing([s / copies for s in v.samples_us], v.mode), copies)
            for name, v in t.items()}, err


def _worst_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error of a row (nan where one is not finite): over the whole
    output, a fault confined to a few rows is diluted by the others."""
    return ((got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max().item()


def _gather_bytes(case: KernelCase) -> int:
    k, n, s = case.shape.in_features, case.shape.out_features, len(case.shape.slice_widths)
    return case.tokens * (s * case.rank * k + n * case.rank) * _elt(case.dtype)


def _check(case, w, x, layout, token_slots) -> dict[str, float]:
    ref = lora_delta_fp32(x, w, token_slots)
    y0 = torch.randn(case.tokens, case.shape.out_features, dtype=case.dtype, device=x.device)
    rows = {}
    y = y0.clone()
    lora_expand(lora_shrink(x, w, layout), w, y, layout)
    rows["triton"] = row_errors(y, y0, ref)
    if _gather_bytes(case) <= TORCH_GATHER_LIMIT:
        y = y0.clone()
        expand_reference(shrink_reference(x, w, layout), w, y, layout)
        rows["torch"] = row_errors(y, y0, ref)
    # The delta is small next to y, so y's own rounding bounds what any kernel can reach.
    rounding = 2 * torch.finfo(case.dtype).eps * (y0.float().norm(dim=-1)
                                                  / ref.norm(dim=-1).clamp_min(1e-30))
    tol = CHECK_TOL[case.dtype] + rounding
    for name, err in rows.items():
        over = (~(err <= tol)).nonzero().flatten().tolist()
        if over:
            row = over[0]
            raise VerificationError(
                f"{case.label}: {name} LoRA output differs from the fp32 reference: row {row} "
                f"relative error {err[row]:.3g} > tolerance {tol[row]:.3g} ({len(over)} of "
                f"{case.tokens} rows over)")
    return {name: err.max().item() for name, err in rows.items()}
