"""LoRA kernel launch shapes and tuning variables found mishandled by the twelfth hunt: each
test failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import kernels.shrink as shrink_module
from kernels import LoRAWeights, SegmentLayout, config, lora_shrink, plan_segments

ROOT = Path(__file__).resolve().parent.parent


def _import_config(env: str, value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import kernels.config"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **{env: value}))


@pytest.mark.parametrize("value", ["256", "1024"])
def test_a_rope_window_past_32_warps_is_named_at_import(value):
    """RoPE's wide-window program runs ``window / 4`` warps: 256 rows asked for 64 warps
    (2,048 threads, past a block's 1,024), which imported fine and then failed in ptxas at the
    first wide launch on the GPU ("Insufficient registers (32)"), naming neither the variable
    nor the fix."""
    out = _import_config("MULTILORA_ROPE_WIDE_WINDOW", value)
    assert out.returncode != 0, "accepted"
    assert f"MULTILORA_ROPE_WIDE_WINDOW={value}: give a power of two" in out.stderr, \
        out.stderr[-2000:]
    assert "128" in out.stderr.splitlines()[-1]


def test_the_widest_rope_window_is_taken():
    out = _import_config("MULTILORA_ROPE_WIDE_WINDOW", "128")
    assert out.returncode == 0, out.stderr[-2000:]


def _joint_launches(monkeypatch, max_rank: int, dtype: torch.dtype) -> list:
    """The shrink's launches (JOINT, BLOCK_R) for a qkv-shaped module of ``max_rank`` over an
    extend layout, joint shrinks on from one row; the output checked against float64."""
    monkeypatch.setattr(config, "SHRINK_JOINT_MIN_ROWS", 0)
    seen = []
    real = shrink_module.launch

    def recorded(kernel, grid, *args, **kwargs):
        seen.append((kwargs["JOINT"], kwargs["BLOCK_R"]))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(shrink_module, "launch", recorded)
    g = torch.Generator().manual_seed(max_rank)
    k = 16
    w = LoRAWeights.for_linear(1, k, [16, 16, 16], max_rank, dtype, DEVICE)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * k**-0.5)
    w.ranks[:1] = torch.tensor([max_rank, 3, 0], dtype=torch.int32)
    layout = SegmentLayout.from_plan(plan_segments([0], [3], block_m=64, skip_slot=1), DEVICE)
    x = torch.randn(3, k, generator=g).to(dtype).to(DEVICE)
    a = lora_shrink(x, w, layout).double().cpu()
    ref = x.double().cpu() @ w.lora_a[0].double().cpu().T
    for lo, hi in ((0, max_rank), (max_rank, max_rank + 3)):
        torch.testing.assert_close(a[:, lo:hi], ref[:, lo:hi], rtol=3e-3, atol=3e-3)
    return seen


@pytest.mark.parametrize("max_rank, dtype", [(256, torch.float16), (128, torch.float32)])
def test_a_joint_shrink_too_wide_for_shared_memory_runs_a_program_a_slice(monkeypatch,
                                                                         max_rank, dtype):
    """``MULTILORA_SHRINK_JOINT_MIN_ROWS`` set: a joint program spans every slice's columns,
    ``rank_block(slices * max_rank)`` rows of A a K step. qkv at r=256 in fp16 (1,024 rows)
    or r=128 in fp32 (512 rows) compiled for sm_90 to 408 KB and 288 KB of shared memory,
    past the SM's 227 KB: the launch failed on the GPU ("out of resource: shared memory").
    Those weights keep a program a slice."""
    assert _joint_launches(monkeypatch, max_rank, dtype) == [
        (False, config.rank_block(max_rank))]


def test_a_joint_shrink_within_shared_memory_stays_joint(monkeypatch):
    """qkv at r=128 in fp16: 512 rows, 216 KB on sm_90, within the SM's 227 KB."""
    assert _joint_launches(monkeypatch, 128, torch.float16) == [(True, 512)]
    assert _joint_launches(monkeypatch, 16, torch.float32) == [(True, 64)]
