"""Two implementations of one capture/replay interface.

``CudaGraph``: ``torch.cuda.CUDAGraph`` in a memory pool shared by all graphs of a runner,
one eager warmup before the capture (compiles Triton kernels, warms cuBLAS).
``TracedGraph``: ``make_fx`` traces the forward into aten ops (Triton launchers appear as one
custom-op node each) and replays the trace. Like a CUDA graph it keeps *references* to the
tensors it read, bakes Python scalars (grid sizes, counts) in as constants, resolves Python
branches (``lora_active``) at capture time and returns one static output that each replay
overwrites, so the stale-state hazards are real on a CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


class Replayable:
    def replay(self) -> torch.Tensor:
        raise NotImplementedError


def capture_cuda_graph(fn: Callable[[], object], warmup: int = 1,
                       pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture ``fn`` into a CUDA graph after ``warmup`` eager calls on a side stream (they
    compile Triton kernels and warm the allocator and cuBLAS outside the capture). Returns the
    graph and what the captured call returned (static outputs, valid after each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Hazard: a garbage collection inside the capture may destroy the CUDA graphs of a runtime
    # dropped earlier (held in reference cycles); destroying a graph is not permitted while a
    # stream captures and invalidates the capture (seen on the H200). torch no longer collects
    # before a capture: the collector stays off until the capture ends.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, output


class CudaGraph(Replayable):
    def __init__(self, fn: Callable[[], torch.Tensor], pool) -> None:
        self.graph, self.output = capture_cuda_graph(fn, warmup=1, pool=pool)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class TracedGraph(Replayable):
    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        # make_fx records each node's metadata through a fake mode: without an ambient one it
        # builds a new FakeTensorMode per value, each capturing a Python stack trace (half of
        # a trace's time). One mode for the whole trace; the traced ops are unchanged.
        with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
            self.module = make_fx(fn)()
        self.output: torch.Tensor | None = None

    def replay(self) -> torch.Tensor:
        # Like a CUDA graph replay, a traced replay is not part of any autograd history.
        # Hazard: a CUDA graph writes every replay into the one output its capture allocated,
        # so a step's logits are gone once the next replay runs; a fresh tensor per replay hid
        # a caller that reads them later (a step run ahead, logits kept without a copy).
        with torch.no_grad():
            out = self.module()
        if self.output is None:
            # Hazard: an output made under torch.inference_mode() is an inference tensor,
            # which a later replay outside it may not write ("Inplace update to inference
            # tensor"); a CUDA graph's output, written by its kernels, takes any mode.
            with torch.inference_mode(False):
                self.output = torch.empty_like(out)
        self.output.copy_(out)
        return self.output


def capture(fn: Callable[[], torch.Tensor], device: torch.device, pool=None) -> Replayable:
    with torch.no_grad():
        if device.type == "cuda":
            return CudaGraph(fn, pool)
        return TracedGraph(fn)


def new_pool(device: torch.device):
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None
