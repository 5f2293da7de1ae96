"""What the engine measures: per request (arrival, first token, finish: TTFT and TPOT) and
per step (mode, batch size, tokens, graph or eager, bucket, duration)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival: float | None = None
    """Clock time the request was added (seconds, the engine's clock)."""
    first_token: float | None = None
    last_token: float | None = None
    """Clock time the latest token was read (the finish, unless ``Engine.abort`` ended it)."""
    finish: float | None = None
    output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        if self.first_token is None or self.arrival is None:
            return None
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (s); None with fewer than two tokens. It ends
        at the last token, not at ``finish``: an aborted request's finish is the abort's time,
        which may come long after its last token."""
        if (self.finish is None or self.last_token is None or self.first_token is None
                or self.output_tokens < 2):
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True)
class StepRecord:
    index: int
    mode: str
    """``extend``, ``decode`` or ``idle``."""
    batch_size: int
    tokens: int
    adapters: tuple[str, ...]
    """Distinct adapters of the step (sorted)."""
    graph: bool
    """Replayed a captured graph (False: eager)."""
    bucket: int | None
    variant: str | None
    """The graph variant replayed: ``lora``, ``peers`` (under DP: LoRA on the gathered MLP
    rows only) or ``base`` (None: eager)."""
    start: float
    seconds: float
    """Host time of the step, forward and sampling included (device work synchronised). With
    ``Engine(overlap=True)``: from the later of its launch and the previous step's end to its
    tokens read, so a pass's steps add up to its wall time."""
    compiles: int | None = None
    """Triton kernel variants the step compiled (None: not observable, e.g. the interpreter).
    Nonzero after ``Engine.warm_up`` means a shape the warm-up did not reach."""
    ahead: bool = False
    """Launched before the previous step's tokens were read (``Engine(overlap=True)``)."""
