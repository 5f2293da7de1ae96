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


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_adapters=16), "popularity 'none' serves the base model only"),
    (dict(num_adapters=-3), "popularity 'none' serves the base model only"),
    (dict(rate=10.0), "arrival='poisson'"),
    (dict(popularity="uniform", num_adapters=4, rate=float("nan")), "arrival='poisson'"),
])
def test_a_parameter_the_spec_would_ignore_is_refused(kwargs, words):
    """``num_adapters`` without a popularity drew a base-model workload, and ``rate`` without
    ``arrival="poisson"`` an offline one: the benchmark measured something else than asked."""
    with pytest.raises(ValueError, match=words):
        WorkloadSpec(8, **kwargs)
    WorkloadSpec(8, num_adapters=0)  # the base model: 0 or the default 1 adapters


@pytest.mark.parametrize("vocab", [0, -5, None, 2.5, "96"])
def test_make_workload_names_a_vocab_size_that_is_not_an_integer_from_1(vocab):
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
        make_workload(WorkloadSpec(2, 3, 2), vocab)


def test_one_seed_draws_the_same_requests_for_every_popularity_and_arrival_process():
    """Adapters and arrival times were drawn from the lengths' stream: at one seed, uniform,
    Zipf and the base model (and offline against Poisson) drew other prompt and output
    lengths, so comparing them compared different workloads."""
    def shapes(**kw):
        wl = make_workload(WorkloadSpec(12, (4, 64), (1, 32), seed=3, **kw), 100)
        return [(w.prompt, w.max_new_tokens) for w in wl], wl

    want, _ = shapes()
    runs = [dict(popularity="identical"), dict(popularity="uniform", num_adapters=4),
            dict(popularity="zipf", num_adapters=4), dict(popularity="distinct", num_adapters=12),
            dict(arrival="poisson", rate=5.0),
            dict(popularity="zipf", num_adapters=4, arrival="poisson", rate=5.0)]
    arrivals = set()
    for kw in runs:
        got, wl = shapes(**kw)
        assert got == want, kw
        if kw.get("arrival") == "poisson":
            arrivals.add(tuple(w.arrival for w in wl))
    assert len(arrivals) == 1, "the arrival times do not depend on the popularity"
    uniform = shapes(popularity="uniform", num_adapters=4)[1]
    assert len({w.adapter for w in uniform}) > 1
    assert [w.adapter for w in uniform] != [w.adapter for w in make_workload(
        WorkloadSpec(12, (4, 64), (1, 32), "uniform", 4, seed=4), 100)], "seeds draw adapters"
