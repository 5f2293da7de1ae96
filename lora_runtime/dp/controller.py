"""``DPController``: which rank serves each request. Every rank runs the same controller over
the same request stream, so each knows its share without a message.

Policies: ``round_robin``; ``least_loaded`` (the rank with the fewest tokens assigned so far,
prompt plus output budget); ``skewed`` (rank 0 gets ``share`` of the requests, the others
split the rest), which leaves ranks 1.. idle for a controllable fraction of the steps."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "skewed")


@dataclass
class DPController:
    size: int
    policy: str = "round_robin"
    share: float = 0.75
    """``skewed``: the fraction of requests rank 0 serves (1.0: the others always idle)."""
    seed: int = 0
    load: list[int] = field(default_factory=list)
    _next: int = 0
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"DP size must be >= 1, got {self.size}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {POLICIES}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        self.load = [0] * self.size
        self._rng = random.Random(self.seed)

    def assign(self, prompt_len: int, max_new_tokens: int) -> int:
        if self.policy == "round_robin":
            rank = self._next % self.size
            self._next += 1
        elif self.policy == "least_loaded":
            rank = min(range(self.size), key=lambda r: (self.load[r], r))
        else:
            u = self._rng.random()
            if self.size == 1 or u < self.share:
                rank = 0
            else:
                rank = 1 + int((u - self.share) / (1 - self.share) * (self.size - 1))
                rank = min(rank, self.size - 1)
        self.load[rank] += prompt_len + max_new_tokens
        return rank
