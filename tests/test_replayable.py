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


def test_a_traced_replay_overwrites_what_the_previous_one_returned():
    """Like a CUDA graph (one static output, written by every replay): a caller that reads a
    replay's output after the next replay reads the next one's values, on a CPU too. The
    stand-in returned a fresh tensor per replay, so a caller wrong on a GPU passed here (the
    engine keeping a step's logits without a copy passed test_engine with overlap)."""
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    graph = capture(lambda: lin(x), torch.device("cpu"))
    first = graph.replay()
    kept = first.clone()
    x.add_(1.0)
    graph.replay()
    torch.testing.assert_close(first, lin(x).detach())
    assert not torch.allclose(first, kept)
