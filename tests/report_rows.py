"""Synthetic result rows of every suite (kernels, model, throughput, idle, dp, base step,
attention), made the way the suites make them, for report tests."""

from __future__ import annotations

import torch

from bench.attention_bench import AttentionCase
from bench.base_step_suite import BaseStepCase
from bench.kernel_bench import KernelCase
from bench.model_bench import ModelCase
from bench.results import make_row
from bench.scenarios import DPCase, IdleCase, ThroughputCase
from bench.timing import Timing

RUN = {"run_id": "20260101-000000-abc", "profile": "gpu", "device": "Fake GPU", "git_sha": "0" * 40,
       "git_dirty": False, "python": "3.12", "torch": "2.11", "cuda": "13.0", "triton": "3.6",
       "driver": "580", "ceilings": {"copy_gbps": 4000.0, "matmul_tflops": 780.0},
       "suite_seconds": {"kernels": 100.0}}
OK = {"status": "verified", "error": None}


def _t(us: float) -> Timing:
    return Timing([us * f for f in (0.98, 1.0, 1.03)], "events")


def rows(scale: float = 1.0) -> list[dict]:
    out = []
    for module in ("qkv_proj", "down_proj"):
        for t in (1, 16, 256):
            for a, r in ((1, 16), (4, 64)):
                case = KernelCase("llama3-8b", module, t, a, r, torch.bfloat16)
                for provider, us in (("triton", 8 + t / 20), ("base", 16 + t / 10)):
                    out.append(make_row(case, "gpu", {"provider": provider},
                                        timing=_t(us * scale), verification=OK, derived={
                                            "x_floor": 50 / t ** 0.5, "pct_of_base": 60.0,
                                            "achieved_gbps": 900.0}))
    # A prefill of the decode rows' context and a batch size of theirs: another case.
    for step, bs in (("decode", 1), ("decode", 8), ("decode", 32), ("prefill", 8)):
        for a, ranks in ((0, ()), (4, (16,)), (4, (8, 16, 64))):
            case = ModelCase(step, "llama3-8b", 4, 256, bs, a, ranks, "triton",
                             torch.bfloat16)
            slow = 3 if step == "prefill" else 1
            for traffic in case.traffics:
                for path, us in (("eager", 5000), ("graph", 1200 + 200 * (traffic == "lora")),
                                 ("replay_only", 1100)):
                    floor = {"lora_floor_us": 11.0 * bs ** 0.5} if traffic == "lora" else {}
                    out.append(make_row(case, "gpu", {"traffic": traffic, "path": path},
                                        timing=_t(us * scale * slow), verification=OK,
                                        derived=floor))
    failed = ModelCase("decode", "llama3-8b", 4, 256, 64, 4, (16,), "triton", torch.bfloat16)
    out.append(make_row(failed, "gpu", {"traffic": "all", "path": "graph"},
                        verification={"status": "failed", "error": "replay differs"}))
    for a, pop in ((0, "-"), (4, "uniform"), (16, "uniform"), (4, "zipf"), (16, "zipf")):
        case = ThroughputCase("llama3-8b", 4, "bfloat16", "in512-out128", 256, a, pop, "16")
        out.append(make_row(case, "gpu", {}, verification=OK, derived={
            "output_tokens_per_s": 9000 / (1 + a / 32), "requests_per_s": 30.0,
            "ttft_p50_ms": 40.0, "tpot_p50_ms": 9.0, "joules_per_token": 0.4}))
    for scenario, bs in (("idle_forward", 0), ("base_batch", 8)):
        case = IdleCase("llama3-8b", 4, "bfloat16", scenario, bs)
        for runtime in ("no_lora", "lora"):
            for path in ("eager", "graph"):
                out.append(make_row(case, "gpu", {"runtime": runtime, "path": path},
                                    timing=_t(300.0), verification=OK))
    for dp in (1, 2):
        for load in ("balanced", "skewed"):
            case = DPCase("llama3-8b", 4, "bfloat16", dp, load, 4, "16")
            out.append(make_row(case, "gpu", {}, verification=OK, derived={
                "output_tokens_per_s": 8000.0 * dp, "idle_share": 0.1 * (load == "skewed"),
                "idle_forward_lora_us": 1100.0, "idle_forward_base_us": 950.0,
                "idle_forward_peers_us": 1050.0 if dp > 1 else None}))
    for bs in (1, 64):
        case = BaseStepCase("llama3-8b", 4, "bfloat16", bs, 512, "triton")
        out.append(make_row(case, "gpu", {}, timing=_t(800.0 + bs), verification=OK,
                            derived={"pct_of_roofline": 80.0, "pct_of_bytes_floor": 78.0}))
        case = AttentionCase("decode", bs, 512)
        out.append(make_row(case, "gpu", {}, timing=_t(10.0 + bs), verification=OK,
                            derived={"x_floor": 1.2}))
    return [r | {"run_id": RUN["run_id"]} for r in out]
