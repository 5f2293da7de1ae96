"""Launchers refuse bad input with a message that names it, and refuse to run unprepared."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU

from kernels import (
    LoRAWeights,
    SegmentLayout,
    StaticSegmentLayout,
    lora_embedding_shrink,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    plan_segments,
)


def _setup(rows=5, k=32, dtype=torch.float32):
    w = LoRAWeights.for_linear(2, k, [8, 4], 4, dtype, DEVICE)
    w.lora_a.normal_()
    w.lora_b.normal_()
    w.ranks[:2] = 4
    w.scalings[:2] = 1.0
    layout = SegmentLayout.from_plan(plan_segments([0, 1, 2, 0, 1][:rows], block_m=16), DEVICE)
    return w, layout, torch.randn(rows, k, dtype=dtype, device=DEVICE)


def test_split_k_adds_up_to_the_unsplit_product():
    w, layout, x = _setup(k=96)
    split = lora_shrink(x, w, layout, split_k=3, block_k=16)
    whole = lora_shrink(x, w, layout, split_k=1, block_k=16)
    rows = [0, 1, 3, 4]  # row 2 is the neutral slot: its output is undefined
    assert torch.allclose(split[rows], whole[rows], rtol=1e-5, atol=1e-4)
    slots = [0, 1, 0, 1]
    ref = torch.stack([w.lora_a[s].double() @ x[r].double()
                       for r, s in zip(rows, slots, strict=True)])
    assert torch.allclose(split[rows].double(), ref, rtol=1e-5, atol=1e-4)


def test_an_eager_gpu_shrink_is_not_split(monkeypatch):
    """An eager forward is bound by its launches' host time: its shrinks on a GPU skip the
    split's memset launch (``config.EAGER_SHRINK_SPLITS``); a graph's keep their split."""
    from kernels import config

    monkeypatch.setattr(config, "programs_wanted", lambda device: 528)  # an H200's 4 x 132
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert config.shrink_split(4096, 128, 48, gpu, None) == (11, 384)
    assert config.shrink_split(4096, 128, 48, gpu, None, eager=True) == (1, 4096)
    assert config.shrink_split(4096, 128, 48, gpu, 3, eager=True)[0] == 3  # forced: tests
    assert config.shrink_split(4096, 128, 48, cpu, None, eager=True) == (11, 384)
    monkeypatch.setattr(config, "EAGER_SHRINK_SPLITS", 0)
    assert config.shrink_split(4096, 128, 48, gpu, None, eager=True) == (11, 384)


def test_unprepared_batch_is_refused_with_the_fix():
    w, _, x = _setup()
    with pytest.raises(ValueError, match="prepare_lora_batch"):
        lora_shrink(x, w, None)


def test_stale_metadata_for_other_row_count_is_refused():
    w, layout, x = _setup()
    with pytest.raises(ValueError, match="covers 5 rows but the input has 3"):
        lora_shrink(x[:3], w, layout)
    with pytest.raises(ValueError, match="stale"):
        lora_expand(torch.zeros(3, 8, device=DEVICE), w, torch.zeros(3, 12, device=DEVICE), layout)


def test_dtype_and_shape_mismatches_name_the_input():
    w, layout, x = _setup()
    with pytest.raises(ValueError, match="lora_a dtype"):
        lora_shrink(x.half(), w, layout)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_shrink(torch.randn(5, 31, device=DEVICE), w, layout)
    with pytest.raises(ValueError, match="contiguous rows"):
        lora_shrink(torch.randn(32, 5, device=DEVICE).t(), w, layout)
    p = lora_shrink(x, w, layout)
    with pytest.raises(ValueError, match="y must be"):
        lora_expand(p, w, torch.zeros(5, 11, device=DEVICE), layout)
    with pytest.raises(ValueError, match="a must be"):
        lora_expand(p[:, :4], w, torch.zeros(5, 12, device=DEVICE), layout)
    with pytest.raises(ValueError, match="embedding"):
        lora_embedding_shrink(torch.zeros(5, dtype=torch.long, device=DEVICE), w, layout)
    with pytest.raises(ValueError, match="block_k"):
        lora_shrink(x, w, layout, block_k=24)



def test_inputs_of_the_wrong_dimension_are_named_not_called_stale():
    """A 1-D or 3-D input was measured as -1 rows against the layout: "the input has -1 rows.
    The metadata is stale: prepare (or reset) the LoRA batch", a fix that cannot help."""
    w, layout, x = _setup()
    we = LoRAWeights.for_embedding(2, 10, 8, 4, torch.float32, DEVICE)
    calls = {
        "x must be 2-D": [lambda: lora_shrink(x[0], w, layout),
                          lambda: lora_shrink(x[:, None], w, layout),
                          lambda: lora_shrink_expand(x[0], w, torch.zeros(5, 12, device=DEVICE),
                                                     layout)],
        "y must be": [lambda: lora_expand(lora_shrink(x, w, layout), w,
                                        torch.zeros(12, device=DEVICE), layout)],
        "token_ids must be 1-D": [lambda: lora_embedding_shrink(
            torch.zeros(5, 1, dtype=torch.long, device=DEVICE), we, layout)],
    }
    for msg, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=msg) as e:
                fn()
            assert "stale" not in str(e.value)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation exists on CPU only")
def test_bf16_under_the_interpreter_is_refused():
    w, layout, x = _setup(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        lora_shrink(x, w, layout)


def test_static_layout_neutralises_rows_and_blocks_it_does_not_use():
    static = StaticSegmentLayout(8, 3, 16, neutral_slot=2, device=DEVICE)
    static.write(plan_segments([0, 1, 0, 1, 0, 1, 0, 1], block_m=16, skip_slot=2), 8)
    static.write(plan_segments([1, 2], block_m=16, skip_slot=2), 4)
    v = static.view(4)
    assert v.token_slots.tolist() == [1, 2, 2, 2]
    assert v.permutation.tolist() == [0, 1, 2, 3]
    assert v.block_slots.tolist() == [1, 2, 2, 2]
    assert (v.block_starts == v.block_ends)[1:].all()
    full = static.view(8)
    assert full.token_slots[4:].tolist() == [2, 2, 2, 2], "rows past the bucket too"
    with pytest.raises(ValueError, match="capacity"):
        static.view(9)
    with pytest.raises(ValueError, match="holds"):
        static.write(plan_segments([0] * 5, block_m=16), 4)


def test_plan_rejects_bad_lengths():
    with pytest.raises(ValueError, match="request_lens"):
        plan_segments([0, 1], [1], block_m=16)
    with pytest.raises(ValueError, match=">= 0"):
        plan_segments([0], [-1], block_m=16)


def test_a_block_m_the_kernels_cannot_take_is_refused_at_planning():
    """Every LoRA kernel spans a block's rows with ``tl.arange(0, block_m)``: a block_m that
    is not a power of two planned fine and then failed inside the kernel's compilation
    ("arange's range must be a power of 2"), naming neither the layout nor the fix."""
    for bad in (24, 0, -16):
        with pytest.raises(ValueError, match=f"block_m must be a positive power of two.*{bad}"):
            plan_segments([0, 1], block_m=bad)
        with pytest.raises(ValueError, match=f"block_m must be a positive power of two.*{bad}"):
            StaticSegmentLayout(4, 3, bad, neutral_slot=2, device=DEVICE)
    for good in (1, 2, 16, 64):
        assert plan_segments([0, 1], block_m=good).block_m == good


def test_a_bad_block_k_is_refused_every_time():
    """Launch shapes are cached per shape; a refused one is not (each call raises)."""
    w, layout, x = _setup()
    for _ in range(2):
        with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 24"):
            lora_shrink(x, w, layout, block_k=24)
    assert lora_shrink(x, w, layout, block_k=16).shape == (5, 8)


def test_bad_rank_and_scaling_tables_are_named_even_after_a_good_launch():
    """The tables' check runs once per weights object and device; a table replaced since
    (another tensor) is checked again."""
    w, layout, x = _setup()
    a = lora_shrink(x, w, layout)
    y = torch.zeros(5, 12, device=DEVICE)
    lora_expand(a, w, y, layout)  # the good tables now count as checked
    good_ranks, good_scalings = w.ranks, w.scalings
    w.ranks = good_ranks.long()
    with pytest.raises(ValueError, match="ranks must be int32"):
        lora_shrink(x, w, layout)
    w.ranks = good_ranks[:2]
    with pytest.raises(ValueError, match="ranks must be int32"):
        lora_expand(a, w, y, layout)
    w.ranks, w.scalings = good_ranks, good_scalings.half()
    with pytest.raises(ValueError, match="scalings must be float32"):
        lora_expand(a, w, y, layout)
    w.scalings = good_scalings
    lora_expand(a, w, y, layout)


def test_mismatches_are_named_after_good_launches_too():
    """What depends on the weights alone is checked once per input signature; a launch with
    another signature after good ones is checked again, shrink, expand and both in one."""
    from kernels import lora_shrink_expand

    w, layout, x = _setup()
    y = torch.zeros(5, 12, device=DEVICE)
    lora_expand(lora_shrink(x, w, layout), w, y, layout)
    lora_shrink_expand(x, w, y, layout)
    with pytest.raises(ValueError, match="lora_a dtype"):
        lora_shrink(x.half(), w, layout)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_shrink_expand(torch.randn(5, 31, device=DEVICE), w, y, layout)
    with pytest.raises(ValueError, match="lora_b dtype"):
        lora_shrink_expand(x, w, y.half(), layout)
    w.lora_b = w.lora_b[:, :, :2].contiguous()  # another tensor, of the wrong rank
    with pytest.raises(ValueError, match="max_rank"):
        lora_expand(lora_shrink(x, w, layout), w, y, layout)


def test_one_launch_reuses_its_checked_arguments_only_for_the_same_signature():
    """``lora_shrink_expand`` keeps its checked launch arguments for one signature: another
    layout of as many rows, a new ranks table or a batch of other rows must not be served
    with the kept ones."""
    from kernels import lora_shrink_expand

    def run(x, w, layout):
        y = torch.zeros(x.shape[0], 12, device=DEVICE)
        lora_shrink_expand(x, w, y, layout)
        return y

    def want(x, w, slots):
        y = torch.zeros(x.shape[0], 12, device=DEVICE)
        lora_expand(lora_shrink(x, w, layouts[slots]), w, y, layouts[slots])
        return y

    w, layout, x = _setup()
    layouts = {s: SegmentLayout.from_plan(plan_segments(list(s), block_m=16), DEVICE)
               for s in ((0, 1, 2, 0, 1), (1, 1, 0, 2, 0))}
    first, other = layouts
    assert torch.allclose(run(x, w, layouts[first]), want(x, w, first), atol=1e-5)
    assert torch.allclose(run(x, w, layouts[other]), want(x, w, other), atol=1e-5)
    w.ranks = w.ranks.clone()
    w.ranks[1] = 2  # a new table object: slot 1 keeps two of its four rows
    assert torch.allclose(run(x, w, layouts[other]), want(x, w, other), atol=1e-5)
    with pytest.raises(ValueError, match="covers 5 rows but the input has 3"):
        run(x[:3], w, layouts[other])


@pytest.mark.parametrize("widths, align", [([4096, 1024, 1024], 16), ([14336, 14336], 16),
                                           ([24, 8], 8), ([20, 12, 36], 4), ([7], 1),
                                           ([16, 3], 1)])
def test_column_align_divides_every_slice_bound(widths, align):
    """The kernels promise the GPU compiler that every slice bound is a multiple of it (their
    column masks then cover whole 16-byte vectors): a value too large would mask columns of
    the next slice in or of this one out."""
    w = LoRAWeights.for_linear(1, 8, widths, 4, torch.float32, "cpu")
    assert w.column_align == align
    assert all(b % w.column_align == 0 for b in w.slice_bounds)


def test_one_launch_programs_walk_the_fewest_tiles_that_fit_one_wave(monkeypatch, request):
    """The one-launch kernel recomputes ``a`` in every program: its programs walk the fewest
    tiles (a power of two, at most 8) that bring the grid within one program an SM; the
    separate expand keeps its own rule. Shapes of the H100 sweep (132 SMs, 128-column
    tiles, rank 16, 8 blocks at T=16 with 8 adapters)."""
    from kernels import config
    from kernels.expand import launch_shape

    monkeypatch.setattr(config, "programs_wanted", lambda device: 4 * 132)
    # launch_shape is cached: the shapes of a 132-SM device must not outlive the test.
    launch_shape.cache_clear()
    request.addfinalizer(launch_shape.cache_clear)
    dev = torch.device("cpu")

    def tiles(widths, blocks, one_launch=True, block_m=16, rank=16):
        return launch_shape(widths, block_m, blocks, rank, dev, None, None, None,
                            one_launch=one_launch)[2]

    assert tiles((4096,), 8) == 2  # down, o_proj: 256 programs at 1 tile, 128 at 2
    assert tiles((4096, 1024, 1024), 8) == 4  # qkv: 192 programs at 2, 96 at 4
    assert tiles((14336, 14336), 8) == 8  # gate_up: 224 programs at the cap
    assert tiles((4096,), 1) == 1  # one block: 32 programs already
    assert tiles((14336, 14336), 1) == 2  # 224 programs at 1, 112 at 2
    assert tiles((128,), 500) == 1  # one tile a block: more tiles would not cut the grid
    assert tiles((4096,), 8, one_launch=False) == 1  # the separate expand at decode
    assert tiles((4096,), 64, one_launch=False, block_m=64, rank=64) == 4
    assert launch_shape((4096,), 16, 8, 16, dev, 16, None, None, one_launch=True)[2] == 8


@pytest.mark.parametrize("block_m, rank, one_launch, shape", [
    (16, 16, False, (64, 1)),  # decode, rank block 16: 64 columns over one warp
    (16, 8, False, (64, 1)),
    (16, 64, False, (128, 4)),  # decode at rank 64: one warp lost on the H200
    (64, 16, False, (128, 4)),  # prefill
    (16, 16, True, (128, 4)),  # the one-launch kernel also runs the shrink
])
def test_expand_launch_shape_by_regime(block_m, rank, one_launch, shape):
    """(block_n, num_warps) of the expand: decode blocks at rank block 16 take 16 x 64 tiles
    over one warp (H200: 5-17% less time than 128 columns over four), every other case
    keeps its wider tiles."""
    from kernels.expand import launch_shape

    got = launch_shape((4096, 4096), block_m, 8, rank, torch.device("cpu"), None, None, None,
                       one_launch=one_launch)
    assert (got[1], got[3]) == shape
