"""Profiles: which cases each suite sweeps on which machine.

``gpu``: Llama-3-8B shapes, bf16, CUDA-graph timing; the whole run is sized for under 10
minutes on an H200. ``gpu-quick``: a smoke run of every suite on a GPU (a few cases each, about
two minutes). ``cpu``: tiny shapes, fp32, Triton interpreter and traced graphs, wall clock: proves
the pipeline end to end; its times mean nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench import (
    attention_bench,
    base_step_suite,
    dp_suite,
    idle_bench,
    kernel_bench,
    model_bench,
    throughput_bench,
)

MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Profile:
    name: str
    cuda: bool
    dtype: torch.dtype
    reps: int
    summary: str


PROFILES = {
    "gpu": Profile("gpu", True, torch.bfloat16, 30, "Llama-3-8B shapes, full sweep (<10 min on "
                   "an H200)"),
    "gpu-quick": Profile("gpu-quick", True, torch.bfloat16, 20, "a GPU smoke run: a few cases "
                         "of each suite (about two minutes)"),
    "cpu": Profile("cpu", False, torch.float32, 3, "tiny shapes on the CPU (Triton interpreter, "
                   "traced graphs): proves the pipeline, times mean nothing"),
}


def kernel_cases(profile: str) -> list[kernel_bench.KernelCase]:
    dt = PROFILES[profile].dtype
    if profile == "gpu":
        return kernel_bench.cases("llama3-8b", MODULES, (1, 16, 64, 256, 2048),
                                  (1, 4, 8, 16, 64), (16, 64), dt)
    if profile == "gpu-quick":
        return kernel_bench.cases("llama3-8b", ("qkv_proj", "gate_up_proj", "down_proj"),
                                  (1, 64, 2048), (1, 8), (16,), dt)
    return kernel_bench.cases("tiny", ("qkv_proj", "down_proj"), (1, 16), (1, 4), (8,), dt)


def model_cases(profile: str) -> list[model_bench.ModelCase]:
    dt = PROFILES[profile].dtype
    if profile == "gpu":
        # Adapter counts at r=16, then ranks (and a mixed-rank set) at 16 adapters.
        runtimes = [(0, ()), (1, (16,)), (4, (16,)), (16, (16,)), (64, (16,)),
                    (16, (8,)), (16, (64,)), (16, (8, 16, 64))]
        return (model_bench.cases("decode", "llama3-8b", 4, 256, (1, 8, 32, 64, 256), runtimes,
                                  "triton", dt)
                + model_bench.cases("prefill", "llama3-8b", 4, 256, (1, 4, 8),
                                    [runtimes[i] for i in (0, 2, 3, 4, 7)], "triton", dt)
                # Full depth at context 512, 8 adapters r=16: the decode-step ratio of the
                # performance issue, against the fast base step.
                + model_bench.cases("decode", "llama3-8b", 32, 512, (1, 16, 64, 256),
                                    [(0, ()), (8, (16,))], "triton", dt))
    if profile == "gpu-quick":
        return (model_bench.cases("decode", "llama3-8b", 2, 128, (1, 32),
                                  [(0, ()), (4, (16,)), (4, (8, 16, 64))], "triton", dt)
                + model_bench.cases("prefill", "llama3-8b", 2, 256, (4,),
                                    [(0, ()), (4, (16,))], "triton", dt))
    return (model_bench.cases("decode", "tiny", 2, 16, (1, 4),
                              [(0, ()), (2, (8,)), (2, (4, 8))], "torch", dt)
            + model_bench.cases("prefill", "tiny", 2, 16, (2,), [(0, ()), (2, (4, 8))], "torch",
                                dt))


def throughput_cases(profile: str):
    if profile == "gpu":
        return throughput_bench.cases(
            "llama3-8b", 4, "bfloat16", 256, 64, 64,
            [(0, "-"), (1, "identical"), (4, "uniform"), (16, "uniform"), (16, "zipf"),
             (64, "distinct")], 16)
    if profile == "gpu-quick":
        return throughput_bench.cases("llama3-8b", 2, "bfloat16", 128, 32, 16,
                                      [(0, "-"), (4, "uniform")], 16)
    return throughput_bench.cases("tiny", 1, "float32", 8, 4, 6, [(0, "-"), (2, "uniform")], 8)


def idle_cases(profile: str):
    if profile == "gpu":
        return idle_bench.cases("llama3-8b", 8, "bfloat16", 256, (1, 8, 64), 4, 16)
    if profile == "gpu-quick":
        return idle_bench.cases("llama3-8b", 2, "bfloat16", 128, (8,), 4, 16)
    return idle_bench.cases("tiny", 2, "float32", 16, (1, 4), 2, 8)


DP_WORKLOAD = {  # requests per rank, lengths and batch limit of every DP case of the profile
    "gpu": {"requests_per_rank": 64, "prompt": 128, "output": 64, "max_batch": 32},
    "gpu-quick": {"requests_per_rank": 32, "prompt": 128, "output": 32, "max_batch": 16},
    "cpu": {"requests_per_rank": 2, "prompt": 6, "output": 3, "max_batch": 2},
}


def dp_cases(profile: str):
    workload = DP_WORKLOAD[profile]
    if profile == "gpu":
        return dp_suite.cases("llama3-8b", 4, "bfloat16", (1, 2, 4, 8), ("balanced", "skewed"),
                              (0, 4), 16, workload)
    if profile == "gpu-quick":
        return dp_suite.cases("llama3-8b", 2, "bfloat16", (1, 2), ("skewed",), (0, 4), 16,
                              workload)
    return dp_suite.cases("tiny", 1, "float32", (1, 2), ("skewed",), (0, 2), 8, workload)


def base_step_cases(profile: str):
    if profile == "gpu":  # 4 layers at two contexts, both kernel sets; full depth at 512
        return (base_step_suite.cases("llama3-8b", 4, "bfloat16", (1, 8, 64, 256), (512, 4096),
                                      ("triton", "torch"))
                + base_step_suite.cases("llama3-8b", 32, "bfloat16", (1, 16, 64, 256), (512,)))
    if profile == "gpu-quick":
        return base_step_suite.cases("llama3-8b", 2, "bfloat16", (1, 64), (512,))
    # Both kernel sets: the Triton ones run in the interpreter (fp32), so the float64 check
    # sees a fault in them too.
    return base_step_suite.cases("tiny", 1, "float32", (1, 3), (16,), ("triton", "torch"))


def attention_cases(profile: str):
    if profile in ("gpu", "gpu-quick"):
        return attention_bench.default_cases(profile == "gpu-quick", True, "bfloat16")
    # The interpreter's bf16 tl.dot is wrong: fp32 and fp16 only.
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    return [attention_bench.AttentionCase("decode", 2, 48, 0, "triton", dtype="float32",
                                          **shape),
            attention_bench.AttentionCase("prefill", 2, 16, 16, "triton", dtype="float16",
                                          **shape),
            attention_bench.AttentionCase("prefill", 2, 16, 16, "torch", dtype="float16",
                                          **shape)]
