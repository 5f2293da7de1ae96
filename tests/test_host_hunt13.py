"""Host side of a LoRA step, thirteenth hunt: batch planning's inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import StaticSegmentLayout, plan_segments


@pytest.mark.parametrize(("slots", "lens", "words"), [
    ([0.7, 1], None, "request_slots"),  # planned as slot 0
    ([0.7, 1], [2, 1], "request_slots"),
    (["1"], None, "request_slots"),  # planned as slot 1
    ([0], [2.5], "request_lens"),  # planned as 2 rows
    ([0, 1], [True, True], "request_lens"),  # bools: one row each
])
def test_a_slot_or_length_that_is_not_an_integer_is_refused_not_truncated(slots, lens, words):
    with pytest.raises(ValueError, match=words):
        plan_segments(slots, lens, block_m=16)


def test_integer_slots_and_lengths_of_any_integer_type_still_plan():
    want = plan_segments([1, 0], [2, 3], block_m=16)
    for slots, lens in ((np.array([1, 0]), np.array([2, 3], dtype=np.int32)),
                        (torch.tensor([1, 0]), (np.int64(2), 3))):
        got = plan_segments(slots, lens, block_m=16)
        assert (got.token_slots, got.permutation, got.blocks) == (
            want.token_slots, want.permutation, want.blocks)
    decode = plan_segments([np.int64(1), torch.tensor(0), 2], block_m=16)
    assert decode.token_slots == [1, 0, 2] and decode.permutation == [1, 0, 2]
    assert plan_segments([], [], block_m=16).num_rows == 0


def test_a_generator_of_slots_with_a_bad_one_is_refused_naming_it():
    with pytest.raises(ValueError, match="request_slots must be integers.*float 0.5"):
        plan_segments((s for s in [0, 0.5]), block_m=16)


@pytest.mark.parametrize("field", ["max_rows", "num_slots", "neutral_slot"])
@pytest.mark.parametrize("bad", [8.0, True])
def test_a_static_layout_refuses_a_size_or_slot_that_is_not_an_integer_naming_it(field, bad):
    args = {"max_rows": 8, "num_slots": 3, "block_m": 16, "neutral_slot": 2, "device": "cpu"}
    with pytest.raises(ValueError, match=f"{field} must be an integer"):
        StaticSegmentLayout(**{**args, field: bad})
    layout = StaticSegmentLayout(**{**args, field: np.int64(args[field])})
    assert type(layout.view(4).max_slot) is int
