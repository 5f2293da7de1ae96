"""A request's KV-cache slots: a list of ints kept in a growable numpy array, so a decode
batch copies each request's slot row at memory speed instead of converting Python ints (at
256 requests of 1024 tokens that conversion cost ~45 ms a step on a 2-core host)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class SlotList:
    """Append-only in practice (``append``, ``extend``, ``pop`` of the tail); list-like."""

    __slots__ = ("_a", "_n")

    def __init__(self, slots: Iterable[int] = ()) -> None:
        a = np.fromiter(slots, dtype=np.int64)
        self._a, self._n = np.resize(a, max(16, len(a))), len(a)

    @property
    def array(self) -> np.ndarray:
        """The slots as an int64 view (valid until the next change)."""
        return self._a[: self._n]

    def _reserve(self, n: int) -> None:
        if n > len(self._a):
            grown = np.empty(max(n, 2 * len(self._a)), dtype=np.int64)
            grown[: self._n] = self._a[: self._n]
            self._a = grown

    def append(self, slot: int) -> None:
        self._reserve(self._n + 1)
        self._a[self._n] = slot
        self._n += 1

    def extend(self, slots: Iterable[int]) -> None:
        new = np.fromiter(slots, dtype=np.int64)
        self._reserve(self._n + len(new))
        self._a[self._n: self._n + len(new)] = new
        self._n += len(new)

    def pop(self) -> int:
        if not self._n:
            raise IndexError("pop from an empty SlotList")
        self._n -= 1
        return int(self._a[self._n])

    def tolist(self) -> list[int]:
        return self.array.tolist()

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self.tolist())

    def __reversed__(self):
        return reversed(self.tolist())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tolist()[i]
        return self.tolist()[i] if i < 0 else int(self.array[i])

    def __eq__(self, other) -> bool:
        if isinstance(other, SlotList):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"SlotList({self.tolist()})"
