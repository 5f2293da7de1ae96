"""The model suite's "replay == eager" must see static LoRA metadata left stale by a skipped
refresh: its verified step was the first of its shape in the runtime, so a refresh skipped
for a same-shape batch with other adapters (here: ``holds`` comparing shapes, not slots) was
never exercised and the case was verified. The case now first replays a same-shape batch
with the adapters shifted."""

from __future__ import annotations

import pytest
import torch

from bench.context import Context
from bench.hardware import Ceilings
from bench.model_bench import ModelCase, RuntimeCache, run_case
from kernels.segments import StaticSegmentLayout

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")


def _holds_by_shape(self, spec, rows):
    held = self._held
    return (held is not None and held[0].request_lens == spec.request_lens
            and held[0].num_rows == spec.num_rows and held[1] <= rows
            and held[2] <= self.blocks_for(rows))


@pytest.mark.parametrize("case", [
    ModelCase("decode", "tiny", 2, 16, 1, 2, (8,), "torch", torch.float32),
    ModelCase("decode", "tiny", 2, 16, 4, 2, (4, 8), "torch", torch.float32),
    ModelCase("prefill", "tiny", 2, 16, 2, 2, (4, 8), "torch", torch.float32)],
    ids=["decode-bs1", "decode-bs4", "prefill-bs2"])
def test_a_stale_lora_layout_fails_the_case(monkeypatch, case):
    monkeypatch.setattr(StaticSegmentLayout, "holds", _holds_by_shape)
    rows = run_case(case, CTX, RuntimeCache([case], CPU))
    assert len(rows) == 1, [r["verification"] for r in rows]
    v = rows[0]["verification"]
    assert v["status"] == "failed" and "graph replay differs from the eager" in v["error"]
    assert rows[0]["stats"] is None


def _static_layout():
    from kernels import plan_segments

    neutral = 2
    plan = plan_segments([0, 1, 0], None, block_m=16, skip_slot=neutral)
    static = StaticSegmentLayout(8, 6, 16, neutral, CPU)
    static.write(plan, 3)
    return static.view(8), neutral


def test_the_neutral_past_check_sees_a_live_block_past_the_batch_or_on_other_rows():
    """The kernels walk blocks, not rows: a live block of an adapter past the batch's rows,
    or pointed by the permutation at rows of another slot, adds a term no row named; the
    check of the static buffers looked only at rows' slots and at unused blocks' slots."""
    from bench.model_runtime import _check_live_blocks

    full, neutral = _static_layout()
    _check_live_blocks(full, 3, neutral)  # as written: fine
    unused = int((full.block_ends <= full.block_starts).nonzero()[0])
    full.block_slots[unused], full.block_starts[unused], full.block_ends[unused] = 0, 3, 4
    with pytest.raises(AssertionError, match="a block of slot 0 covers rows"):
        _check_live_blocks(full, 3, neutral)

    full, neutral = _static_layout()
    live = (full.block_ends > full.block_starts) & (full.block_slots == 0)
    start = int(full.block_starts[live.nonzero()[0]])
    row_of_slot_1 = int((full.token_slots == 1).nonzero()[0])
    full.permutation[start] = row_of_slot_1
    with pytest.raises(AssertionError, match="a block of slot 0 covers rows"):
        _check_live_blocks(full, 3, neutral)
