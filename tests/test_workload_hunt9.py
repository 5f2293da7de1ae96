"""Workload, scheduling and timing defects found in hunt 9, each pinned by a test that failed
before its fix.

Before: ``WorkloadSpec`` took a Poisson rate or a Zipf exponent given as an integer past
float's range (JSON reads 400 digits as an int), which ``make_workload`` then failed on with
"OverflowError: int too large to convert to float", naming neither the field nor the fix; a
Zipf exponent given as a numpy integer (a numpy sweep's value) failed there with numpy's
"Integers to negative integer powers are not allowed".
``bench_time`` on a CPU took any ``mode`` (a misspelt one timed the wall clock), so a suite's
typo passed every CPU run and was refused only on the GPU."""

from __future__ import annotations

import numpy
import pytest
import torch

from bench.timing import bench_time
from lora_runtime.engine.workload import WorkloadSpec, make_workload


@pytest.mark.parametrize("kwargs, words", [
    (dict(arrival="poisson", rate=10**400), "finite rate > 0"),
    (dict(popularity="zipf", num_adapters=3, zipf_alpha=10**400), "zipf_alpha must be finite"),
])
def test_a_rate_or_zipf_alpha_past_floats_range_is_refused_by_the_spec(kwargs, words):
    with pytest.raises(ValueError, match=words):
        make_workload(WorkloadSpec(3, 2, 1, **kwargs), 16)


def test_an_integer_zipf_alpha_within_floats_range_still_draws():
    wl = make_workload(WorkloadSpec(6, 2, 1, popularity="zipf", num_adapters=3,
                                    zipf_alpha=10**300), 16)
    assert {w.adapter for w in wl} == {"adapter-0"}


def test_bench_time_refuses_an_unknown_mode_on_a_cpu_too():
    with pytest.raises(ValueError, match="mode must be 'graph', 'events' or 'latency'"):
        bench_time(lambda: None, device=torch.device("cpu"), mode="graphs", reps=1)
    assert bench_time(lambda: None, device=torch.device("cpu"), mode="events", reps=2).stats()[
        "n"] == 2


@pytest.mark.parametrize("alpha", [numpy.int64(2), numpy.int32(1)])
def test_a_numpy_integer_zipf_alpha_draws_the_workload_of_its_int(alpha):
    """The spec takes numpy integers (as for the seed and lengths); the weights raised numpy's
    "Integers to negative integer powers are not allowed"."""
    spec = dict(num_requests=12, prompt_len=2, output_len=1, popularity="zipf", num_adapters=3)
    assert make_workload(WorkloadSpec(**spec, zipf_alpha=alpha), 16) == make_workload(
        WorkloadSpec(**spec, zipf_alpha=int(alpha)), 16)
