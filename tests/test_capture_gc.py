"""A CUDA graph capture survives garbage that holds pinned host memory (a dropped runtime's
slot images): with the collector free to run inside the capture, freeing such memory records
an event on its copy's stream and invalidates the capture. The collector is made to run on
every allocation here, so without ``capture_cuda_graph`` keeping it off this fails."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import ON_GPU

from graphs.replayable import capture_cuda_graph


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_capture_with_pinned_garbage_pending():
    device = torch.device("cuda")
    x = torch.randn(256, device=device)

    def fn():
        junk = [[] for _ in range(50)]  # Python allocations: the collector's trigger
        del junk
        return x * 2 + 1

    old = gc.get_threshold()
    try:
        for _ in range(4):
            cycle = {"pinned": torch.randn(1 << 16).pin_memory()}
            cycle["self"] = cycle  # only the collector frees it
            torch.empty(1 << 16, device=device).copy_(cycle["pinned"], non_blocking=True)
            del cycle
        gc.set_threshold(1)
        graph, out = capture_cuda_graph(fn, warmup=1)
    finally:
        gc.set_threshold(*old)
    x.copy_(torch.arange(256, device=device, dtype=torch.float32))
    graph.replay()
    torch.testing.assert_close(out, torch.arange(256, device=device) * 2.0 + 1)
    assert gc.isenabled()
