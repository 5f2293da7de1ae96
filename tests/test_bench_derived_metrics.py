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
