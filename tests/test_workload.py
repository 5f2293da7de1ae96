"""``make_workload``: what a spec the checks accept draws."""

from __future__ import annotations

import numpy

from lora_runtime.engine.workload import WorkloadSpec, make_workload


def test_a_numpy_integer_seed_draws_the_workload_of_its_int():
    """The spec takes numpy integers (as it does for lengths); make_workload raised TypeError
    from ``random.Random`` on such a seed."""
    spec = WorkloadSpec(4, (2, 6), 2, popularity="uniform", num_adapters=3,
                        seed=numpy.int64(7))
    assert make_workload(spec, 50) == make_workload(WorkloadSpec(4, (2, 6), 2, "uniform", 3,
                                                                 seed=7), 50)
