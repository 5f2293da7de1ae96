"""Hunt 13, the base model's kernels and the model code calling them: a float64 model under
the Triton backend, positions and cache slots outside the rotary table and the KV cache on
CPU tensors, and the attention launchers' tile and split overrides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, ON_GPU

from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.model.backend import base_backend, use_base_backend
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM


def _served(dtype, slots: int = 64) -> ModelRunner:
    model = LlamaForCausalLM.random(tiny(1), dtype, DEVICE, seed=1)
    return ModelRunner(model, KVCache(model.config, slots, dtype, DEVICE), None)


def _prefill_then_decode(runner: ModelRunner) -> list[torch.Tensor]:
    reqs = [Request([1, 2, 3], None, 4), Request([5], None, 4)]
    logits = [runner.forward_eager(build_extend(reqs, runner.kv, DEVICE))]
    for r in reqs:
        r.output.append(7)
    logits.append(runner.forward_eager(build_decode(reqs, runner.kv, DEVICE)))
    return logits


def test_a_float64_model_runs_its_base_step_under_the_triton_backend():
    """float64 is a served dtype (``LlamaForCausalLM.random``/``load_hf_llama`` take it), but
    the base kernels take fp16, bf16 and fp32: its first forward under the Triton backend (a
    GPU's default) raised "x has dtype torch.float64; expected fp16, bf16 or fp32"."""
    with use_base_backend("triton"):
        assert base_backend(torch.device("cuda"), torch.float64) == "torch"
        assert base_backend(torch.device("cuda"), torch.float32) == "triton"
    with use_base_backend("torch"):
        want = _prefill_then_decode(_served(torch.float64))
    with use_base_backend("triton"):
        got = _prefill_then_decode(_served(torch.float64))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _one_token_batch(runner: ModelRunner, position: int, slot: int | None = None):
    batch = build_extend([Request([1], None, 4)], runner.kv, DEVICE)
    batch.positions.fill_(position)
    if slot is not None:
        batch.out_cache_loc.fill_(slot)
    return batch


@pytest.mark.skipif(ON_GPU, reason="the check is made on CPU tensors only (no device sync)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("position", [512, -1])
def test_positions_outside_the_rotary_table_are_named_on_cpu(backend, position):
    """Position 512 of a 512-row table: the torch path raised a bare IndexError, the Triton
    kernel read past the table (a larger one segfaulted the interpreter); -1 read the last
    row in the torch path, silently. Nothing is written to the cache."""
    runner = _served(torch.float32)
    batch = _one_token_batch(runner, position)
    before = [c.clone() for c in runner.kv.k + runner.kv.v]
    with use_base_backend(backend), pytest.raises(
            ValueError, match=rf"positions \[{position}\] are outside the rotary table 0\.\.511 "
                              r"\(max_position_embeddings\)"):
        runner.forward_eager(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv.k + runner.kv.v, strict=True))


@pytest.mark.skipif(ON_GPU, reason="the check is made on CPU tensors only (no device sync)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cache_slots_outside_the_kv_cache_are_named_on_cpu(backend):
    """The Triton kernel wrote K/V past the cache's end (heap memory), the torch path raised
    index_copy_'s IndexError."""
    runner = _served(torch.float32, slots=64)  # slots 0..64: 0 is the scratch slot
    batch = _one_token_batch(runner, 0, slot=65)
    with use_base_backend(backend), pytest.raises(
            ValueError, match=r"cache_loc \[65\] are outside the KV cache's slots 0\.\.64"):
        runner.forward_eager(batch)


def test_the_last_position_and_the_last_cache_slot_are_served():
    """The tables' ends are inside: both backends agree there."""
    logits = []
    for backend in ("torch", "triton"):
        runner = _served(torch.float32, slots=64)
        with use_base_backend(backend):
            logits.append(runner.forward_eager(_one_token_batch(runner, 511, slot=64)))
        assert runner.kv.k[0][64].abs().sum() > 0, "K written to the last slot"
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(40, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    table = torch.arange(1, 37, device=DEVICE).reshape(2, 18)
    return q, k, v, table, torch.tensor([7, 18], device=DEVICE)


def test_numpy_integer_overrides_run_as_python_ints():
    """``splits=np.int64(2)`` was refused as "must be an integer ... got np.int64(2)", and a
    numpy block size failed inside the kernel ("cannot convert 15 of type numpy.int64")."""
    q, k, v, table, lens = _decode_inputs()
    want = decode_attention(q, k, v, table, lens, 0.25, 2, (16, 4, 1))
    got = decode_attention(q, k, v, table, lens, 0.25, np.int64(2), tuple(np.int64([16, 4, 1])))
    assert torch.equal(got, want)
    starts = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    kv_starts = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, table[0], starts, kv_starts, 0.25)
    want = extend_attention(*args, (16, 16, 4, 1))
    assert torch.equal(extend_attention(*args, tuple(np.int64([16, 16, 4, 1]))), want)


@pytest.mark.parametrize("tiles,says", [
    ((16.0, 4, 1), "block_n must be a power of two >= 16, got 16.0"),
    ((16, 4), r"tiles must be \(block_n, num_warps, num_stages\), got \(16, 4\)"),
    ((16, 3, 1), "num_warps must be a power of two >= 1, got 3"),
    ((16, 4, 0), "num_stages must be an integer >= 1, got 0"),
])
def test_bad_decode_tiles_are_named(tiles, says):
    """A float block raised "unsupported operand type(s) for &", a short tuple "not enough
    values to unpack"; num_warps and num_stages went unchecked to the compiler."""
    q, k, v, table, lens = _decode_inputs()
    with pytest.raises(ValueError, match=says):
        decode_attention(q, k, v, table, lens, 0.25, None, tiles)


@pytest.mark.parametrize("tiles,says", [
    ((16, 32.0, 4, 1), "block_n must be a power of two >= 16, got 32.0"),
    ((16, 16, 4), r"tiles must be \(block_m, block_n, num_warps, num_stages\), got "
                  r"\(16, 16, 4\)"),
])
def test_bad_extend_tiles_are_named(tiles, says):
    q, k, v, table, _ = _decode_inputs()
    starts = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=says):
        extend_attention(q, k, v, table[0], starts, starts, 0.25, tiles)
