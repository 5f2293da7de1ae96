"""Ceilings measured in the same run as the numbers judged against them."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

from bench.timing import bench_time


@dataclass
class Ceilings:
    device_name: str
    copy_gbps: float
    """Device-to-device copy, bytes read + written per second / 1e9."""
    matmul_tflops: float
    """Dense matmul in the benchmark dtype on random data."""
    l2_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def measure(device: torch.device, dtype: torch.dtype) -> Ceilings:
    if device.type == "cuda":
        return _measure_cuda(device, dtype)
    return _measure_cpu()


def _measure_cuda(device, dtype) -> Ceilings:
    props = torch.cuda.get_device_properties(device)
    n = 512 * 1024 * 1024  # 1 GiB of bf16: far above the L2
    copy_s = _copy_seconds(n, device)
    mm_s = _matmul_seconds(8192, device, dtype)
    torch.cuda.empty_cache()
    return Ceilings(
        device_name=props.name,
        copy_gbps=2 * n * 2 / copy_s / 1e9,
        matmul_tflops=2 * 8192**3 / mm_s / 1e12,
        l2_bytes=getattr(props, "L2_cache_size", 50 * 2**20),
    )


def _copy_seconds(n: int, device) -> float:
    src = torch.randn(n // 2, device=device, dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    return bench_time(lambda: dst.copy_(src), device=device, mode="events", reps=20).median_us / 1e6


def _matmul_seconds(m: int, device, dtype) -> float:
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    return bench_time(lambda: torch.mm(a, b), device=device, mode="events", reps=10).median_us / 1e6


def _measure_cpu() -> Ceilings:
    cpu = torch.device("cpu")
    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    copy = bench_time(lambda: dst.copy_(src), device=cpu, reps=5).quantile(0.0) / 1e6
    m = 512
    a, b = torch.randn(m, m), torch.randn(m, m)
    mm = bench_time(lambda: torch.mm(a, b), device=cpu, reps=5).median_us / 1e6
    return Ceilings(
        device_name=f"cpu ({platform.processor() or platform.machine()})",
        copy_gbps=2 * src.numel() * 4 / copy / 1e9,
        matmul_tflops=2 * m**3 / mm / 1e12,
        l2_bytes=0,
    )
