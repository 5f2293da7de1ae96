"""A CUDA graph capture survives garbage that holds other CUDA graphs (a dropped runtime's,
in reference cycles): a collection inside the capture destroys them, which is not permitted
while a stream captures and invalidates the capture. The collector is made to run on every
allocation here, so without ``capture_cuda_graph`` keeping it off this fails."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import ON_GPU

from graphs.replayable import capture_cuda_graph


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_capture_with_dropped_graphs_pending_collection():
    device = torch.device("cuda")
    x = torch.randn(256, device=device)

    def fn():
        gc.set_threshold(1)  # inside the capture: collect on the next allocations
        junk = [[] for _ in range(50)]
        del junk
        return x * 2 + 1

    old = gc.get_threshold()
    gc.set_threshold(10**9)  # nothing is collected before the capture begins
    try:
        for _ in range(4):
            dropped = {"graph": capture_cuda_graph(lambda: x + 1, warmup=0)}
            dropped["self"] = dropped  # only the collector frees it
            del dropped
        graph, out = capture_cuda_graph(fn, warmup=0)
    finally:
        gc.set_threshold(*old)
    x.copy_(torch.arange(256, device=device, dtype=torch.float32))
    graph.replay()
    torch.testing.assert_close(out, torch.arange(256, device=device) * 2.0 + 1)
    assert gc.isenabled()
