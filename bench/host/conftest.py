"""Options and fixtures of the host-path benchmarks. ``python -m bench.host`` (``nox -s
hostbench``) or ``pytest bench/host`` runs them; the test suite never collects this folder
(``testpaths = ["tests"]``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from bench import provenance
from bench.host.world import HostShape, HostWorld
from lora_runtime.model.modules import BY_NAME as SUPPORTED_TARGETS


def pytest_addoption(parser) -> None:
    g = parser.getgroup("host path", "host-path benchmarks (bench/host)")
    default = HostShape()
    g.addoption("--host-batch-sizes", default=",".join(map(str, default.batch_sizes)),
                help="decode batch sizes, comma-separated (default %(default)s)")
    g.addoption("--host-adapters", type=int, default=default.adapters,
                help="adapters, each in its own slot, round-robin over the requests")
    g.addoption("--host-rank", type=int, default=default.rank)
    g.addoption("--host-context", type=int, default=default.context,
                help="tokens each request has cached (default %(default)s)")
    g.addoption("--host-targets", default=",".join(default.targets),
                help="LoRA target modules (PEFT names; the host path does not depend on them, "
                     "the set-up time does)")
    g.addoption("--host-threads", type=int, default=1,
                help="torch intra-op threads (default 1: the host path is one Python thread; "
                     "on a busy machine a parallel copy waits for a descheduled worker, "
                     "turning 40 us into milliseconds)")
    g.addoption("--host-devices", default="auto",
                help="cpu, cuda or cpu,cuda (default auto: cpu, and cuda when available)")


def pytest_configure(config) -> None:
    # Every --host-* value is checked here, before collection: a bad one was a collection
    # traceback (int() of "x", HostShape's ValueError), an INTERNALERROR (--host-threads 0)
    # or an error in every test's set-up (--host-devices gpu), none naming the flag.
    threads = config.getoption("--host-threads")
    if threads < 1:
        raise pytest.UsageError(f"--host-threads {threads}: give a positive thread count")
    host_shape(config)
    host_devices(config)
    torch.set_num_threads(threads)


def _positive_option(config, flag: str) -> int:
    value = config.getoption(flag)
    if value < 1:
        raise pytest.UsageError(f"{flag} {value}: must be >= 1")
    return value


def host_shape(config) -> HostShape:
    text = config.getoption("--host-batch-sizes")
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise pytest.UsageError(f"--host-batch-sizes {text!r}: give distinct positive integers "
                                "joined by commas, e.g. 1,64,256")
    targets = tuple(config.getoption("--host-targets").split(","))
    unknown = [t for t in targets if t not in SUPPORTED_TARGETS]
    if unknown or len(set(targets)) != len(targets):
        raise pytest.UsageError(f"--host-targets {','.join(targets)!r}: give distinct target "
                                f"modules of {', '.join(sorted(SUPPORTED_TARGETS))} joined by "
                                "commas")
    return HostShape(sizes, _positive_option(config, "--host-adapters"),
                     _positive_option(config, "--host-rank"),
                     _positive_option(config, "--host-context"), targets=targets)


def host_devices(config) -> list[str]:
    want = config.getoption("--host-devices")
    if want == "auto":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = want.split(",")
    if not set(devices) <= {"cpu", "cuda"} or len(set(devices)) != len(devices):
        raise pytest.UsageError(f"--host-devices {want!r}: give cpu, cuda or cpu,cuda (or "
                                "auto)")
    if "cuda" in devices and not torch.cuda.is_available():
        raise pytest.UsageError("--host-devices names cuda but no CUDA device is available")
    return devices


def pytest_generate_tests(metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", host_devices(metafunc.config))
    if "bs" in metafunc.fixturenames:
        metafunc.parametrize("bs", host_shape(metafunc.config).batch_sizes,
                             ids=lambda bs: f"bs{bs}")


@functools.cache
def _world(shape: HostShape, device: str) -> HostWorld:
    return HostWorld(shape, torch.device(device))  # capture is the costly part: once each


@pytest.fixture
def world(request, device: str) -> HostWorld:
    w = _world(host_shape(request.config), device).reset()
    yield w
    w.reset()


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    devices = host_devices(config)
    device = torch.device(devices[-1])
    run = provenance.collect(device)
    run.pop("command", None)
    machine_info["multilora"] = run | {
        "device_slug": provenance.device_slug(device),  # names the run file
        "devices": devices, "host_shape": dataclasses.asdict(host_shape(config)),
        "torch_threads": torch.get_num_threads()}
