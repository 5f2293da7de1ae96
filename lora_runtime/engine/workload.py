"""Synthetic serving workloads for benchmarks and tests, and ``serve``, which feeds one to an
engine at its arrival times.

Adapter popularity: ``none`` (base model only), ``identical`` (all requests use one adapter),
``uniform`` or ``zipf`` (alpha) over ``num_adapters``, ``distinct`` (one adapter per request).
Arrivals: ``offline`` (all at time 0: throughput) or ``poisson`` at ``rate`` requests/s."""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from lora_runtime.checks import is_finite_number, is_int
from lora_runtime.engine.requests import Request

POPULARITY = ("none", "identical", "uniform", "zipf", "distinct")
ARRIVALS = ("offline", "poisson")
Length = int | tuple[int, int]


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: Length = 128
    """Fixed, or (lo, hi) drawn uniformly, both included."""
    output_len: Length = 32
    popularity: str = "none"
    num_adapters: int = 1
    zipf_alpha: float = 1.0
    arrival: str = "offline"
    rate: float = 0.0
    """Requests per second (poisson)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_adapters", "seed"):
            if not is_int(getattr(self, name)):  # seed None would draw anew each call
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.seed < 0:  # random.Random seeds an int by its absolute value
            raise ValueError(f"seed must be >= 0, got {self.seed}: a negative seed would draw "
                             f"the workload of seed {-self.seed}")
        if self.popularity not in POPULARITY:
            raise ValueError(f"popularity {self.popularity!r}: choose one of {POPULARITY}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival {self.arrival!r}: choose one of {ARRIVALS}")
        for name in ("rate", "zipf_alpha"):
            # A string ("5", from a config file) failed in the comparisons below with "'<' not
            # supported between instances of 'int' and 'str'"; True passed as 1.
            x = getattr(self, name)
            if not isinstance(x, numbers.Real) or isinstance(x, bool):
                raise ValueError(f"{name} must be a number, got {type(x).__name__} {x!r:.80}")
        # A rate so small that its mean gap 1 / rate overflows (1e-320) drew every arrival at
        # inf, which serve() then refused; an int past float's range (10**400) passed here
        # and make_workload raised OverflowError naming neither field.
        if self.arrival == "poisson" and not (is_finite_number(self.rate) and self.rate > 0
                                              and math.isfinite(1 / self.rate)):
            raise ValueError(f"poisson arrivals need a finite rate > 0 (requests per second), "
                             f"got {self.rate!r:.80}")
        if not (is_finite_number(self.zipf_alpha) and self.zipf_alpha >= 0):
            raise ValueError(f"zipf_alpha must be finite and >= 0, got {self.zipf_alpha!r:.80}")
        if self.popularity in ("uniform", "zipf") and self.num_adapters < 1:
            raise ValueError(f"{self.popularity} popularity needs num_adapters >= 1")
        # Parameters whose companion defaults to off were ignored: WorkloadSpec(64,
        # num_adapters=16) drew a base-model workload, WorkloadSpec(64, rate=10.0) an offline one.
        if self.popularity == "none" and self.num_adapters not in (0, 1):
            raise ValueError(f"popularity 'none' serves the base model only; got num_adapters="
                             f"{self.num_adapters}: choose popularity 'uniform', 'zipf' or "
                             "'distinct' to spread requests over adapters")
        if self.arrival == "offline" and self.rate != 0:
            raise ValueError(f"rate={self.rate!r} is the rate of poisson arrivals, but arrival "
                             "is 'offline' (every request at time 0): pass arrival='poisson'")
        # A case labelled with num_adapters must load that many (``adapter_names``).
        if self.popularity == "identical" and self.num_adapters != 1:
            raise ValueError(f"identical popularity uses one adapter; got num_adapters="
                             f"{self.num_adapters}")
        # (1, the default, was let through too: a case labelled adapters=1 served N.)
        if self.popularity == "distinct" and self.num_adapters != self.num_requests:
            raise ValueError(f"distinct popularity gives each of the {self.num_requests} "
                             f"requests its own adapter; got num_adapters={self.num_adapters} "
                             f"(give {self.num_requests})")
        for name in ("prompt_len", "output_len"):
            x = getattr(self, name)
            if not (is_int(x) or isinstance(x, tuple) and len(x) == 2
                    and all(is_int(v) for v in x)):
                raise ValueError(f"{name} must be an integer or a (lo, hi) pair of integers, "
                                 f"got {x!r}")
            lo, hi = _bounds(x)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be >= 1 (or a range lo <= hi), got "
                                 f"{getattr(self, name)}")

    @property
    def adapter_names(self) -> list[str]:
        """The adapters this workload's requests name (load these before serving)."""
        n = {"none": 0, "identical": 1, "distinct": self.num_requests}.get(self.popularity,
                                                                             self.num_adapters)
        return [f"adapter-{i}" for i in range(n)]


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int]
    adapter: str | None
    max_new_tokens: int
    arrival: float
    """Seconds after the workload starts."""


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[WorkloadRequest]:
    if not is_int(vocab_size) or vocab_size < 1:  # randrange named neither it nor the fix
        raise ValueError(f"make_workload: vocab_size must be an integer >= 1 (the model's "
                         f"config.vocab_size), got {vocab_size!r:.80}")
    rng = random.Random(int(spec.seed))  # a numpy integer is no seed random.Random takes
    # Adapters and arrival times draw from their own streams: drawn from ``rng`` between the
    # requests' lengths, they made one seed give other lengths for each popularity and arrival
    # process (uniform against Zipf at seed 1 compared different workloads).
    adapter_rng = random.Random(f"adapters-{int(spec.seed)}")
    arrival_rng = random.Random(f"arrivals-{int(spec.seed)}")
    names = spec.adapter_names
    # float: numpy refuses an integer to a negative integer power (zipf_alpha=np.int64(2)).
    alpha = float(spec.zipf_alpha)
    weights = ([(i + 1) ** -alpha for i in range(len(names))]  # 0 past 1e-308
               if spec.popularity == "zipf" else None)
    t, out = 0.0, []
    for i in range(spec.num_requests):
        if spec.popularity == "none":
            adapter = None
        elif spec.popularity in ("identical", "uniform"):
            adapter = adapter_rng.choice(names)
        elif spec.popularity == "zipf":
            adapter = adapter_rng.choices(names, weights)[0]
        else:
            adapter = names[i]
        if spec.arrival == "poisson":
            t += arrival_rng.expovariate(spec.rate)
        prompt = [rng.randrange(vocab_size) for _ in range(_draw(rng, spec.prompt_len))]
        out.append(WorkloadRequest(prompt, adapter, _draw(rng, spec.output_len), t))
    return out


def serve(engine, workload: list[WorkloadRequest],
          sleep: Callable[[float], None] | None = None) -> list[Request]:
    """Adds each request once its arrival time has passed on the engine's clock, stepping the
    engine meanwhile (idle until the next arrival when nothing runs). Returns the requests in
    workload order. Every request is checked before any is queued: one the engine could never
    serve raises ValueError naming its index, and nothing is served."""
    sleep = sleep or time.sleep
    if not isinstance(workload, WorkloadSpec):  # read once: a generator's length was asked
        workload = list(workload)
    checked = _checked(engine, workload)
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    reqs: list[Request | None] = [None] * len(workload)
    t0 = engine.clock()
    k = 0
    while k < len(pending) or engine.has_work:
        now = engine.clock() - t0
        while k < len(pending) and workload[pending[k]].arrival <= now:
            w = workload[pending[k]]
            req = engine._queue(checked[pending[k]])  # engine.add_request, checked up front
            # It arrived while the last step ran: its wait for that step counts in its TTFT.
            req.metrics.arrival = t0 + w.arrival
            reqs[pending[k]] = req
            k += 1
        if engine.has_work:
            engine.step()
        elif k < len(pending):
            sleep(max(0.0, workload[pending[k]].arrival - now))
    return reqs  # type: ignore[return-value]


def _checked(engine, workload: list[WorkloadRequest]) -> list[Request]:
    """``workload``'s requests, each checked as ``Engine.add_request`` checks it; raises,
    naming the request, where one would be refused (a request too long for the KV cache was
    refused at its arrival, after the earlier ones had been queued and were left running)."""
    if isinstance(workload, WorkloadSpec):
        raise TypeError("serve takes a workload's requests, not its spec: pass "
                        "make_workload(spec, vocab_size)")
    out = []
    for i, w in enumerate(workload):
        if not is_finite_number(w.arrival) or w.arrival < 0:
            raise ValueError(f"workload[{i}].arrival must be a finite number of seconds >= 0 "
                             f"after the workload starts, got {w.arrival!r}")
        try:
            out.append(engine._checked(w.prompt, w.adapter, w.max_new_tokens, ()))
        except ValueError as e:
            raise ValueError(f"workload[{i}] (arrival {w.arrival:.3f} s) would be refused, so "
                             f"nothing was served: {e}") from e
    return out


def _bounds(x: Length) -> tuple[int, int]:
    return (x, x) if is_int(x) else (x[0], x[1])


def _draw(rng: random.Random, x: Length) -> int:
    lo, hi = _bounds(x)
    return rng.randint(lo, hi)
