"""Derived figures of the benchmark suite against hand-computed values: each formula matches
its documented definition (medians of even counts, floors counting each byte once)."""

from __future__ import annotations

import types

import torch

from bench import dp_bench


def test_dp_idle_forward_us_is_the_median_of_an_even_number_of_samples(monkeypatch):
    # Replays timed 1, 2, 3 and 10 us after 5 untimed ones: the median is 2.5 us (the upper
    # middle, 3 us, was reported; the profiles' repetitions, 20 and 30, are even). The clock
    # is read once a warm-up replay (its start) and twice a timed one.
    readings = iter([0.0] * 5 + [0.0, 1e-6, 0.0, 2e-6, 0.0, 3e-6, 0.0, 10e-6])
    monkeypatch.setattr(dp_bench, "time", types.SimpleNamespace(
        perf_counter=lambda: next(readings)))
    graph = types.SimpleNamespace(buffers=types.SimpleNamespace(buckets=[1]), graphs={},
                                  replay=lambda batch, bucket, variant: None)
    eng = types.SimpleNamespace(lora=None)
    dp = types.SimpleNamespace(size=1)
    us = dp_bench._idle_forward_us(eng, graph, "base", dp, torch.device("cpu"), reps=4)
    assert abs(us - 2.5) < 1e-6, us


def _fake_timings(monkeypatch, medians: dict[str, float]):
    """The kernel suite's timed providers replaced by fixed samples (the derivation alone)."""
    from bench import kernel_bench
    from bench.timing import Timing

    def timed(*names):
        return {n: (Timing([medians[n]] * 3, "wall"), 1) for n in names}

    monkeypatch.setattr(kernel_bench, "_time_lora", lambda *a: (
        timed("triton", "triton_shrink", "triton_expand"), {"triton": 0.0}))
    monkeypatch.setattr(kernel_bench, "_time_module", lambda *a: (
        timed("module", "module_serial"), 0.0))
    monkeypatch.setattr(kernel_bench, "_time_eager", lambda *a: (
        timed("module_eager", "base_eager"), 0.0))
    monkeypatch.setattr(kernel_bench, "_time_base", lambda *a: timed("base")["base"])


def test_kernel_module_floor_reads_x_and_writes_the_output_once(monkeypatch):
    from bench import kernel_bench
    from bench.context import Context
    from bench.hardware import Ceilings
    from bench.kernel_bench import KernelCase

    # llama3-8b qkv_proj, T=256, 8 adapters of rank 64, bf16: x 256x4096, W 6144x4096, the 8
    # adapters' A (3 slices x 64 x 4096) and B (6144 x 64), the fp32 shrink output
    # (256 x 3 x 64, written and read), the output 256 x 6144 written once.
    case = KernelCase("llama3-8b", "qkv_proj", 256, 8, 64, torch.bfloat16)
    want = (256 * 4096 * 2 + 4096 * 6144 * 2 + 8 * 3 * 64 * 4096 * 2 + 8 * 6144 * 64 * 2
            + 2 * 256 * 3 * 64 * 4 + 256 * 6144 * 2)
    assert want == 74_842_112  # 83,230,720 before: x read twice, the output three times
    fl = kernel_bench.floors(case)
    assert fl["module"][0] == want
    assert fl["module"][1] == fl["base"][1] + fl["lora"][1]

    # The rows: tiny qkv_proj (in 64, out 64 + 32 + 32), T=1, one adapter of rank 8, fp32.
    tiny = KernelCase("tiny", "qkv_proj", 1, 1, 8, torch.float32)
    tiny_bytes = 64 * 4 + 64 * 128 * 4 + 3 * 8 * 64 * 4 + 128 * 8 * 4 + 2 * 3 * 8 * 4 + 128 * 4
    assert tiny_bytes == 43_968
    medians = {"triton": 5.0, "triton_shrink": 2.0, "triton_expand": 3.0, "base": 10.0,
               "module": 12.0, "module_serial": 14.0, "module_eager": 30.0, "base_eager": 20.0}
    _fake_timings(monkeypatch, medians)
    ctx = Context(torch.device("cpu"), Ceilings("cpu", 10.0, 0.1, 0), reps=3, profile="cpu")
    rows = {r["provider"]: r["derived"] for r in kernel_bench.run_case(tiny, ctx)}
    for name in ("module", "module_serial", "module_eager"):
        d = rows[name]
        assert d["floor_bytes"] == tiny_bytes, (name, d["floor_bytes"])
        floor_us = max(tiny_bytes / 10e3, d["floor_flops"] / 0.1e6)
        assert abs(d["floor_us"] - floor_us) < 1e-9
        assert abs(d["x_floor"] - medians[name] / floor_us) < 1e-9
    assert abs(rows["module"]["lora_added_pct"] - 20.0) < 1e-9  # (12 - 10) / 10
    assert abs(rows["module_serial"]["lora_added_pct"] - 40.0) < 1e-9
    assert abs(rows["module_eager"]["lora_added_pct"] - 50.0) < 1e-9  # 30 / 20, rep by rep
    assert abs(rows["triton"]["pct_of_base"] - 50.0) < 1e-9
    # achieved GB/s: the LoRA floor's bytes over the median (bytes / us / 1e3).
    lora_bytes = rows["triton"]["floor_bytes"]
    # The LoRA term alone: no W, and the output it adds into read as well as written.
    assert lora_bytes == tiny_bytes - 64 * 128 * 4 + 128 * 4
    assert abs(rows["triton"]["achieved_gbps"] - lora_bytes / 5.0 / 1e3) < 1e-9
