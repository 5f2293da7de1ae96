"""The phases of a step (``lora_runtime.nvtx``) as named ranges: what ``nox -s profile``'s
torch-profiler trace (and nsys, through NVTX, on a GPU) shows of a LoRA replay."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from graph_harness import shared

from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.nvtx import PHASES, nvtx_range, phase


def test_a_lora_replay_records_its_phases_under_the_profiler():
    h = shared("torch", DEVICE).reset()
    h.adapter("a", 4, ["q_proj", "down_proj"], seed=1)
    reqs = [Request([1, 2, 3], "a"), Request([4, 5], None)]
    batch = build_extend(reqs, h.runner.kv, DEVICE)
    h.prefill.replay(batch)  # the first replay of a kind may warm caches: not the one traced
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        h.prefill.replay(batch)
    names = [e.name for e in prof.events()]
    for name in ("plan", "buffer refresh", "replay"):
        assert name in names, f"phase {name!r} missing from the trace ({sorted(set(names))[:20]})"
    release(reqs, h.runner.kv)
    h.reset()


def test_ranges_nest_and_unknown_phases_are_refused():
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, nvtx_range("outer"), phase("plan"):
        torch.ones(2).sum()
    names = [e.name for e in prof.events()]
    assert "outer" in names and "plan" in names
    with nvtx_range("quiet"):  # no profiler recording: a no-op on CPU
        pass
    with pytest.raises(ValueError, match="unknown phase"):
        phase("planning")
    assert "collective" in PHASES
