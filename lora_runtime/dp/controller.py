"""``DPController``: which rank serves each request. Every rank runs the same controller over
the same request stream, so each knows its share without a message.

Policies: ``round_robin``; ``least_loaded`` (the rank with the fewest tokens assigned so far,
prompt plus output budget); ``skewed`` (rank 0 gets ``share`` of the requests, the others
split the rest), which leaves ranks 1.. idle for a controllable fraction of the steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Real

from lora_runtime.checks import is_int

POLICIES = ("round_robin", "least_loaded", "skewed")


@dataclass
class DPController:
    size: int
    policy: str = "round_robin"
    share: float = 0.75
    """``skewed``: the fraction of requests rank 0 serves (1.0: the others always idle). Met
    exactly at every prefix of the stream (rank 0's count is the nearest to ``share`` x the
    requests so far), the rest going round-robin over ranks 1.., so a short stream is as
    skewed as a long one."""
    load: list[int] = field(init=False)
    """Tokens assigned to each rank so far (prompt plus output budget)."""
    _assigned: int = field(init=False, default=0)
    _to_zero: int = field(init=False, default=0)
    _to_others: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not is_int(self.size) or self.size < 1:
            raise ValueError(f"DP size must be an integer >= 1, got {self.size!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {POLICIES}")
        if (not isinstance(self.share, Real) or isinstance(self.share, bool)
                or not 0.0 <= self.share <= 1.0):
            raise ValueError(f"share must be a number in [0, 1], got {self.share!r}")
        self.load = [0] * self.size

    def assign(self, prompt_len: int, max_new_tokens: int) -> int:
        for name, v in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
            if not is_int(v) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.policy == "round_robin":
            rank = self._assigned % self.size
        elif self.policy == "least_loaded":
            rank = min(range(self.size), key=lambda r: (self.load[r], r))
        elif self.size == 1 or self._to_zero < round((self._assigned + 1) * self.share):
            rank = 0
            self._to_zero += 1
        else:
            rank = 1 + self._to_others % (self.size - 1)
            self._to_others += 1
        self._assigned += 1
        self.load[rank] += prompt_len + max_new_tokens
        return rank
