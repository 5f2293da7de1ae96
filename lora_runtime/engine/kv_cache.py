"""Token-slot KV cache: per layer ``[slots, kv_heads, head_dim]``; slot 0 is scratch (padding
rows and idle forwards write there), so a graph replay's padding never touches a request."""

from __future__ import annotations

import torch

from lora_runtime.checks import is_int
from lora_runtime.model.config import LlamaConfig


class KVCache:
    SCRATCH = 0

    def __init__(self, config: LlamaConfig, max_tokens: int, dtype: torch.dtype, device) -> None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (KV slots), got {max_tokens!r}")
        shape = (max_tokens + 1, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.max_tokens = max_tokens
        self.reset()

    def reset(self) -> None:
        """Frees every slot (the cache contents stay; nothing reads a freed slot)."""
        self._free = list(range(self.max_tokens, 0, -1))
        # The same slots as a set: a free checks against it in C (a double free would hand
        # one slot to two requests, each overwriting the other's K/V).
        self._free_set = set(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if not is_int(n) or n < 0:  # -2 returned no slot, 2.5 failed in a slice
            raise ValueError(f"KVCache.alloc takes a number of slots (an integer >= 0), got "
                             f"{n!r:.80}")
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} slots requested, {len(self._free)} free. "
                               "Finish requests or build the runtime with a larger max_tokens")
        free = self._free
        cut = len(free) - n
        out = free[cut:][::-1]  # the last n, last first: the order of n pops
        del free[cut:]
        self._free_set.difference_update(out)
        return out

    def free(self, slots: list[int]) -> None:
        """Returns allocated slots; refuses (changing nothing) a slot that is not an integer,
        the scratch slot, a slot out of range, one given twice or one already free."""
        slots = list(slots)
        given = set(slots)
        if not given:
            return
        if not set(map(type, slots)) <= {int} and not all(map(is_int, slots)):
            # 1.5 passed every check below: the free list grew past the cache, and alloc then
            # handed out 1.5, read as slot 1, which another request held.
            raise ValueError(f"KV slots must be integers, got "
                             f"{[s for s in slots if not is_int(s)][:5]!r}")
        if self.SCRATCH in given:
            raise ValueError("slot 0 is the scratch slot and is never allocated")
        if min(given) < 1 or max(given) > self.max_tokens:
            raise ValueError(f"KV slots must lie in 1..{self.max_tokens}, got "
                             f"{sorted(s for s in given if not 1 <= s <= self.max_tokens)[:5]}")
        if len(given) != len(slots) or not given.isdisjoint(self._free_set):
            twice = sorted(given & self._free_set) or sorted(
                s for s in given if slots.count(s) > 1)
            raise ValueError(f"KV slots {twice[:5]} are already free or given twice: a double "
                             "free would hand one slot to two requests")
        self._free.extend(reversed(slots))
        self._free_set.update(given)
