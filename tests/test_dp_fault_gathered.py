"""The MLP's gathered layout under DP (``ForwardBatch.gathered``) checked against the batch and
the group (``lora_runtime.engine.forward_batch.check_gathered``): missing, for another number of
ranks, with a rank's rows past ``rows_per_rank``, or with this rank's rows other than the
batch's, it is refused naming what differs. Unchecked, a sharded model's eager forward failed
in its first MLP on ``'NoneType' object has no attribute 'rows_per_rank'`` (on one rank: its
peers waited in the all-gather until the timeout), and a layout whose rows of this rank named
other adapters or lengths than the batch's computed other logits, silently (on a DP=1 world
below: by 1.2 and 1.8 at most)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from dp_world import CONFIG, MAX_RANK, adapters
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.dp.group import DPGroup
from lora_runtime.dp.launch import spawn
from lora_runtime.engine.forward_batch import (
    ForwardBatch,
    ForwardMode,
    GatheredRows,
    check_gathered,
)
from lora_runtime.engine.requests import Request, build_decode, build_extend, release

EXTEND, DECODE, IDLE = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.IDLE


@pytest.fixture(scope="module")
def runtime():
    runner = make_runtime(CONFIG, dtype=torch.float32, device="cpu", slots=2, max_rank=MAX_RANK,
                          targets=ALL_TARGETS, kv_tokens=64)
    ad = adapters()[0]
    runner.lora.load_adapter(ad.name, ad)
    return runner


@pytest.fixture
def extend_batch(runtime):
    """Rank 0's batch: a 4-token prompt on ad0 and a 2-token one on the base model."""
    reqs = [Request([1, 2, 3, 4], "ad0", 2), Request([5, 6], None, 2)]
    batch = build_extend(reqs, runtime.kv, "cpu")
    yield batch
    release(reqs, runtime.kv)


def _dp(rank: int = 0, size: int = 2) -> DPGroup:
    """The group's place only: the check runs before any collective."""
    return DPGroup(rank, size, None, None, 1.0)


def _with(batch: ForwardBatch, mode=EXTEND, rows=8, adapters=(("ad0", None), ("ad0",)),
          lens=((4, 2), (3,))) -> ForwardBatch:
    return dataclasses.replace(batch, gathered=GatheredRows(mode, rows, adapters, lens))


@pytest.mark.parametrize("change, says", [
    (dict(gathered=None), "batch.gathered is None"),
    (dict(adapters=((None, None), ("ad0",))), "are not the batch's"),
    (dict(adapters=(("ad0",), ("ad0", None)), lens=((4,), (3, 2))), "are not the batch's"),
    (dict(lens=((2, 4), (3,))), "are not the batch's"),
    (dict(adapters=(("ad0", None),), lens=((4, 2),)), "the MLP gathers 2 ranks' rows"),
    (dict(adapters=(("ad0", None), ("ad0", None)),), "2 adapters for 1 requests' lengths"),
    (dict(lens=((4, 2), (9,))), "rank 1 9 rows, more than its rows_per_rank 8"),
    (dict(rows=5), "rank 0 6 rows, more than its rows_per_rank 5"),
    (dict(rows=-1), "integer >= 0"), (dict(rows=8.0), "integer >= 0"),
    (dict(mode=IDLE), "gathered.mode"), (dict(mode=DECODE), "mixes modes"),
])
def test_a_gathered_layout_that_cannot_be_the_steps_is_refused(extend_batch, change, says):
    if "gathered" in change:
        batch = extend_batch
    else:
        batch = _with(extend_batch, **change)
    before = batch.gathered
    with pytest.raises(ValueError, match=says):
        check_gathered(batch, _dp())
    assert batch.gathered is before  # a check: nothing changed


def test_consistent_layouts_pass(runtime, extend_batch):
    check_gathered(_with(extend_batch), _dp())
    # Rank 1 of the same step: its own rows are the second entry.
    reqs = [Request([7, 8, 9], "ad0", 2)]
    mine = build_extend(reqs, runtime.kv, "cpu")
    try:
        check_gathered(_with(mine), _dp(rank=1))
        for r in reqs:
            r.output.append(3)
        check_gathered(dataclasses.replace(build_decode(reqs, runtime.kv, "cpu"), gathered=(
            GatheredRows(DECODE, 1, ((), ("ad0",)), ((), (1,))))), _dp(rank=1))
    finally:
        release(reqs, runtime.kv)
    idle = GatheredRows(DECODE, 2, ((), ("ad0", None)), ((), (1, 1)))
    check_gathered(ForwardBatch.idle(None, "cpu", idle), _dp())
    # An unsharded model (a DPEngine of one rank): no layout, or one of this rank's rows.
    check_gathered(extend_batch, None)
    check_gathered(_with(extend_batch, adapters=(("ad0", None),), lens=((4, 2),)), None)
    with pytest.raises(ValueError, match="shard_mlp"):
        check_gathered(_with(extend_batch), None)


def _forwards_rank(rank: int, out_dir: str) -> None:
    """A DP=1 world (the MLP sharded over one rank, gathered for real): each layout's eager
    forward against the consistent one's, and what ``check_gathered`` says of it."""
    from dp_control_world import _sharded_runner

    from lora_runtime.dp.group import init_dp, shutdown

    dp = init_dp(torch.device("cpu"))
    runner = _sharded_runner(dp)
    ad = adapters()[0]
    runner.lora.load_adapter(ad.name, ad)
    layouts = {"consistent": ((("ad0",),), ((4,),)), "none": None,
               "other adapter": (((None,),), ((4,),)), "other lengths": ((("ad0",),), ((2,),))}
    log = {}
    for key, layout in layouts.items():
        req = Request([1, 2, 3, 4], "ad0", 2)
        batch = build_extend([req], runner.kv, "cpu")
        if layout is not None:
            batch = dataclasses.replace(batch, gathered=GatheredRows(EXTEND, 4, *layout))
        try:
            check_gathered(batch, dp)
            log[key + " check"] = "ok"
        except ValueError as e:
            log[key + " check"] = f"ValueError: {e}"
        try:
            log[key] = runner.forward_eager(batch).clone()
        except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
            log[key] = f"{type(e).__name__}: {e}"
        release([req], runner.kv)
        runner.lora.reset_lora_batch()
    torch.save(log, Path(out_dir, "forwards.pt"))
    shutdown(torch.device("cpu"))


@pytest.fixture(scope="module")
def forwards(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_gathered")
    spawn(_forwards_rank, 1, str(out), timeout_s=30.0)
    return torch.load(out / "forwards.pt")


BAD = ("none", "other adapter", "other lengths")


def test_the_check_refuses_the_layouts_that_computed_wrong_logits(forwards):
    assert forwards["consistent check"] == "ok"
    assert isinstance(forwards["consistent"], torch.Tensor)
    for key in BAD:
        said = forwards[key + " check"]
        assert said.startswith("ValueError") and "gathered" in said, (key, said)
        out = forwards[key]
        if isinstance(out, torch.Tensor):  # the unchecked forward: wrong, and silently
            assert (out - forwards["consistent"]).abs().max() > 0.1, key


def test_a_sharded_models_eager_forward_refuses_a_bad_layout(forwards):
    for key in BAD:
        said = forwards[key]
        assert isinstance(said, str) and said.startswith("ValueError"), (key, said)
        assert "gathered" in said, said
