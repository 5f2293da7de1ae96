"""``make_workload``: what a spec the checks accept draws."""

from __future__ import annotations

import numpy
import pytest

from lora_runtime.engine.workload import WorkloadSpec, make_workload


def test_a_numpy_integer_seed_draws_the_workload_of_its_int():
    """The spec takes numpy integers (as it does for lengths); make_workload raised TypeError
    from ``random.Random`` on such a seed."""
    spec = WorkloadSpec(4, (2, 6), 2, popularity="uniform", num_adapters=3,
                        seed=numpy.int64(7))
    assert make_workload(spec, 50) == make_workload(WorkloadSpec(4, (2, 6), 2, "uniform", 3,
                                                                 seed=7), 50)


def test_a_negative_seed_is_refused_not_drawn_as_its_absolute_value():
    """``random.Random`` seeds an int by its absolute value: seed -7 drew seed 7's workload, so
    a sweep over seeds -n..n served each workload twice."""
    spec = dict(num_requests=4, prompt_len=(2, 6), output_len=(1, 5), popularity="uniform",
                num_adapters=3)
    with pytest.raises(ValueError, match=r"seed must be >= 0, got -7.*seed 7"):
        WorkloadSpec(**spec, seed=-7)
    assert make_workload(WorkloadSpec(**spec, seed=0), 50) != make_workload(
        WorkloadSpec(**spec, seed=1), 50)
