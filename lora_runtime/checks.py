"""Checks of user-given values shared by the runtime's validators."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer of any integral type (numpy's included); bool is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
