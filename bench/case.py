"""A benchmark case: a frozen dataclass whose fields are the key of its result rows (a new
field is a new axis, so it never overwrites other rows) and whose ``label`` is at once the
``--filter`` text, the NVTX range name and the filter of its reproduce command."""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import ClassVar

import torch

_SPECIAL = re.compile(r"([.^$*+?{}\[\]\\|()])")


def exact(label: str) -> str:
    """A regex matching ``label`` only (spaces left readable, unlike ``re.escape``)."""
    return "^" + _SPECIAL.sub(r"\\\1", label) + "$"


def _plain(v):
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, tuple):
        return "/".join(str(x) for x in v)
    return v


@dataclasses.dataclass(frozen=True)
class Case:
    suite: ClassVar[str] = ""

    @property
    def label(self) -> str:
        raise NotImplementedError

    def key(self) -> dict:
        """The case's own fields, JSON-ready (dtypes by name, tuples joined with '/')."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def reproduce(self, profile: str) -> str:
        """A command that runs this case alone."""
        return (f"python -m bench --profile {profile} --suite {self.suite} "
                f"--filter {shlex.quote(exact(self.label))}")


def select(cases: list[Case], pattern: str) -> list[Case]:
    """Cases whose label matches ``pattern`` (``re.search``)."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise SystemExit(f"--filter {pattern!r} is not a valid regex: {e}") from None
    return [c for c in cases if rx.search(c.label)]
