"""The CPU graph stand-in replays outside autograd, like a CUDA graph: outputs of a replay
never require grad, even when the captured function reads parameters and grad mode is on."""

from __future__ import annotations

import torch

from graphs.replayable import TracedGraph, capture


def test_traced_replay_records_no_autograd_history():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    graph = capture(lambda: lin(x), torch.device("cpu"))
    assert isinstance(graph, TracedGraph)
    with torch.enable_grad():
        out = graph.replay()
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, lin(x).detach())
    x.add_(1.0)  # a replay reads the referenced tensor's current contents
    torch.testing.assert_close(graph.replay(), lin(x).detach())
