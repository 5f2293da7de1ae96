"""Checks of user-given values shared by the runtime's validators."""

from __future__ import annotations

import math
import numbers


def is_int(value) -> bool:
    """An integer of any integral type (numpy's included); bool is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(x) -> bool:
    """A real, finite number; bool is not one (JSON's true would pass as 1), nor an integer
    past float's range (JSON reads 400 digits as an int, on which math.isfinite raises
    OverflowError)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def is_positive_number(x) -> bool:
    return is_finite_number(x) and x > 0
