"""The host-path benchmarks' layout check fails on the faults it exists for (so a benchmark
cannot time a broken planner or refresh): a block mixing slots, an adapter row no block
covers, padding rows that keep an adapter, a non-empty block past the batch."""

from __future__ import annotations

import pytest

from bench.host.checks import HostCheckError, check_layout

NEUTRAL = 4
SLOTS = [1, 0, 1, NEUTRAL]  # row 3 is a base-model request
PERM = [1, 0, 2, 3]  # rows sorted by slot
GOOD = [(0, 0, 1), (1, 1, 3)]


def _check(token_slots=SLOTS, perm=PERM, blocks=GOOD, want=SLOTS):
    check_layout(token_slots, perm, blocks, want, NEUTRAL, block_m=16, what="test")


def test_a_correct_layout_passes_with_neutral_capacity_past_it():
    _check()
    _check(SLOTS + [NEUTRAL] * 2, PERM + [4, 5], GOOD + [(NEUTRAL, 0, 0)] * 3)


@pytest.mark.parametrize("fault", [
    dict(blocks=[(0, 0, 2), (1, 2, 3)]),                # block 0 runs a row of slot 1
    dict(blocks=[(0, 0, 1), (1, 1, 2)]),                # row 2 of slot 1 is in no block
    dict(token_slots=SLOTS + [1], perm=PERM + [4]),     # a padding row keeps slot 1
    dict(blocks=GOOD + [(1, 1, 1)]),                    # an empty block keeps slot 1
    dict(blocks=GOOD + [(NEUTRAL, 3, 4)]),              # the neutral slot gets a block
])
def test_a_broken_layout_fails(fault):
    with pytest.raises(HostCheckError):
        _check(**fault)
