"""Which adapter sits in which GPU slot; LRU eviction that never evicts an adapter of the
batch being prepared, nor a pinned one, and takes the ``spare`` ones (the running requests')
last. Pure bookkeeping: the manager copies the weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class SlotPoolError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owner: list[str | None] = [None] * num_slots
        self.slot_of: dict[str, int] = {}
        self.pinned: set[str] = set()
        self._last_use: dict[str, int] = {}
        self._clock = 0
        self.version = 0
        """Bumped by every change of ``slot_of`` (a plan of equal adapter names at the same
        version gets the same slots)."""

    def plan(self, names: Iterable[str], protected: Iterable[str] = (),
             spare: Callable[[], Iterable[str]] = tuple
             ) -> list[tuple[int, str, str | None]]:
        """(slot, adapter, evicted) for each adapter of ``names`` not yet in a slot, never
        evicting ``protected`` ones (a batch already prepared), and those ``spare()`` names
        only where no other is left (least recently used first within each; called only
        when a slot must be freed). Raises before changing anything when they cannot all
        fit."""
        wanted = set(names)
        if all(n in self.slot_of for n in wanted):
            return []  # every step of a steady batch: all resident (so they fit)
        keep = wanted | set(protected) | self.pinned
        if len(wanted) > self.num_slots:
            raise SlotPoolError(
                f"the batch uses {len(wanted)} distinct adapters but the pool has "
                f"{self.num_slots} slots (max_loras_per_batch). Split the batch or raise "
                "max_loras_per_batch"
            )
        missing = sorted(n for n in wanted if n not in self.slot_of)
        free = [s for s, o in enumerate(self.owner) if o is None]
        spare = set(spare())
        victims = sorted((o for o in self.owner if o is not None and o not in keep),
                         key=lambda o: (o in spare, self._last_use.get(o, -1)))
        if len(missing) > len(free) + len(victims):
            raise SlotPoolError(
                f"no slot for {missing[len(free) + len(victims):]}: every slot holds an adapter "
                f"of this batch or a pinned one (pinned: {sorted(self.pinned)}). Unpin one, or "
                "raise max_loras_per_batch"
            )
        out = []
        for name in missing:
            if free:
                out.append((free.pop(0), name, None))
            else:
                victim = victims.pop(0)
                out.append((self.slot_of[victim], name, victim))
        return out

    def assign(self, slot: int, name: str) -> None:
        old = self.owner[slot]
        if old is not None:
            del self.slot_of[old]
        self.owner[slot] = name
        self.slot_of[name] = slot
        self.version += 1

    def release(self, name: str) -> int | None:
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.owner[slot] = None
            self.version += 1
        self._last_use.pop(name, None)
        self.pinned.discard(name)
        return slot

    def touch(self, names: Iterable[str]) -> None:
        self._clock += 1
        for n in names:
            self._last_use[n] = self._clock
