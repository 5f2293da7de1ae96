"""SlotList behaves like the list of slots it replaces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_runtime.engine.requests import Request
from lora_runtime.engine.slots import SlotList


@given(st.lists(st.one_of(st.integers(1, 10**6).map(lambda s: ("append", s)),
                          st.lists(st.integers(1, 10**6), max_size=40).map(lambda s: ("extend", s)),
                          st.just(("pop", None))), max_size=60))
def test_matches_a_list(ops):
    ours, ref = SlotList([3, 4]), [3, 4]
    for op, arg in ops:
        if op == "pop":
            if not ref:
                with pytest.raises(IndexError):
                    ours.pop()
                continue
            assert ours.pop() == ref.pop()
        else:
            getattr(ours, op)(arg)
            getattr(ref, op)(arg)
        assert len(ours) == len(ref) and ours == ref and list(ours) == ref
        assert ours.array.tolist() == ref and list(reversed(ours)) == ref[::-1]
        if ref:
            assert ours[0] == ref[0] and ours[-1] == ref[-1] and ours[1:] == ref[1:]


def test_a_request_converts_assigned_lists():
    r = Request([1, 2, 3])
    r.kv_slots = [7, 8]
    assert isinstance(r.kv_slots, SlotList) and r.kv_slots == [7, 8]
    assert r.num_tokens == 3 and r.last_token == 3 and r.uncached == 1
