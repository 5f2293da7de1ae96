"""Kernel inputs and launch heuristics found mishandled by the seventh hunt: each test failed
before its fix."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU

from kernels import LoRAWeights, SegmentLayout, config, plan_segments
from kernels.expand import launch_shape


@pytest.fixture(autouse=True)
def _fresh_launch_shapes():
    """Launch shapes are cached per shape: none computed under a patched device size may
    reach another test."""
    launch_shape.cache_clear()
    yield
    launch_shape.cache_clear()


def test_one_launch_tiles_count_each_slices_own_groups(monkeypatch):
    """The one-launch grid is blocks x the sum over slices of ``cdiv(slice tiles, tiles)``
    (no group straddles two slices). The tile rule counted ``cdiv(sum of tiles, tiles)``:
    gate_up of 65 tiles a slice at 4 blocks stopped at 4 tiles (4 x 33 = 132 "programs")
    while the launch had 4 x (17 + 17) = 136, past one program an SM; 8 tiles fit (72)."""
    monkeypatch.setattr(config, "programs_wanted", lambda device: 4 * 132)
    dev = torch.device("cpu")
    for widths, blocks in (((8320, 8320), 4), ((384, 128, 128, 128), 33)):
        groups, _, tiles, _ = launch_shape(widths, 16, blocks, 16, dev, None, None, None,
                                           one_launch=True)
        assert blocks * groups <= 132, (widths, blocks, tiles, groups)
        if tiles > 1:  # the fewest: half as many tiles would not fit
            half = sum(config.cdiv(config.cdiv(w, 128), tiles // 2) for w in widths)
            assert blocks * half > 132, (widths, blocks, tiles)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation exists on CPU only")
def test_bf16_weights_into_a_float32_output_are_refused_under_the_interpreter():
    """y may be float32 (a delta) over weights of another dtype, and only y's dtype was held
    to the interpreter's bf16 refusal: bf16 B into a float32 y (an embedding's gather, whose
    ids need no bf16 x) added terms off by ~1e10, silently."""
    from kernels import lora_embedding_shrink, lora_expand
    from kernels.lora_epilogue import PendingLoRA
    from kernels.silu_mul import silu_mul

    w = LoRAWeights.for_embedding(2, 10, 32, 16, torch.bfloat16, DEVICE)
    w.lora_a.normal_()
    w.lora_b.normal_()
    w.ranks[:2] = 16
    w.scalings[:2] = 1.0
    layout = SegmentLayout.from_plan(plan_segments([0, 1, 0], block_m=16), DEVICE)
    a = lora_embedding_shrink(torch.tensor([1, 2, 3], device=DEVICE), w, layout)
    y = torch.zeros(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="lora_b is bf16 but TRITON_INTERPRET=1"):
        lora_expand(a, w, y, layout)
    assert not y.any()
    lin = LoRAWeights.for_linear(2, 8, [16, 16], 16, torch.bfloat16, DEVICE)
    with pytest.raises(ValueError, match="lora_b is bf16 but TRITON_INTERPRET=1"):
        silu_mul(y, PendingLoRA(torch.zeros(3, 32, device=DEVICE), lin, layout))


@pytest.mark.parametrize("env, value, says", [
    # A bare "invalid literal for int() with base 10: '64x'" from the import, naming neither
    # the variable nor the fix.
    ("MULTILORA_ONE_LAUNCH_MAX_ROWS", "64x", "MULTILORA_ONE_LAUNCH_MAX_ROWS='64x': give an "
     "integer"),
    ("MULTILORA_NORM_EPILOGUE_MAX_ROWS", "", "MULTILORA_NORM_EPILOGUE_MAX_ROWS='': give an "
     "integer"),
    # Imported fine, then a by-rows consumer computing the shrink of an input wider than 768
    # columns failed to compile ("arange's range must be a power of 2": its K step is this
    # over the rank chunk).
    ("MULTILORA_ROW_SHRINK_ELEMENTS", "12288", "MULTILORA_ROW_SHRINK_ELEMENTS=12288: give a "
     "power of two"),
    # tl.dot's rows and tl.arange both need a power of two from 16.
    ("MULTILORA_ROPE_WIDE_WINDOW", "24", "MULTILORA_ROPE_WIDE_WINDOW=24: give a power of two"),
    ("MULTILORA_ROPE_WIDE_WINDOW", "8", "MULTILORA_ROPE_WIDE_WINDOW=8: give a power of two"),
    # ptxas takes a register cap it cannot meet, or none past 255.
    ("MULTILORA_WIDE_MAXNREG", "300", "MULTILORA_WIDE_MAXNREG=300: give 0"),
    ("MULTILORA_WIDE_MAXNREG", "-1", "MULTILORA_WIDE_MAXNREG=-1: give 0"),
])
def test_a_bad_tuning_variable_is_named_at_import(env, value, says):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", "import kernels.config"], capture_output=True,
                         text=True, cwd=root, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(root), **{env: value}))
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
