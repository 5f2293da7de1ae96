"""The cuBLAS settings held around captures (``lora_runtime.model.gemm_library``): which rows
get cuBLASLt, which delta-route GEMMs leave SMs free, that both are restored (after an error
too) and that nothing changes outside their rows or off the GPU. cuBLAS's own state is faked
here (a CPU build of torch cannot select cuBLASLt); the GPU test checks replays under both."""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU
from graph_harness import Harness
from runtime_helpers import ALL_TARGETS, make_runtime

from graphs import GraphRunner
from kernels import config
from lora_runtime.engine.requests import Request, build_decode, build_extend
from lora_runtime.model import gemm_library
from lora_runtime.model.config import tiny
from lora_runtime.model.gemm_library import rows_library, sms_left_free

CUDA = torch.device("cuda")


@pytest.fixture
def blas(monkeypatch):
    """cuBLAS's library and SM carveout as a dict, with every change logged."""
    state = {"library": "cublas", "carveout": None, "log": []}

    def library(name=None):
        if name is not None:
            state["log"].append(("library", name))
            state["library"] = name
        return state["library"]

    def set_carveout(sms):
        state["log"].append(("carveout", sms))
        state["carveout"] = sms

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["carveout"])
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", set_carveout)
    return state


@pytest.mark.parametrize("rows,lt", [(7, False), (8, True), (32, True), (33, False)])
def test_rows_in_the_range_capture_with_cublaslt(blas, monkeypatch, rows, lt):
    monkeypatch.setattr(config, "CAPTURE_GEMM_LT_ROWS", (8, 32))
    with rows_library(rows, CUDA):
        inside = (blas["library"], blas["carveout"])
    assert inside == (("cublaslt" if lt else "cublas"), None)
    assert (blas["library"], blas["carveout"]) == ("cublas", None)
    assert bool(blas["log"]) == lt  # outside the range nothing is touched


def test_rows_library_leaves_a_cpu_capture_alone(blas, monkeypatch):
    monkeypatch.setattr(config, "CAPTURE_GEMM_LT_ROWS", (1, 10**6))
    with rows_library(16, torch.device("cpu")):
        pass
    assert blas["log"] == []


@pytest.mark.parametrize("rows,sms,free", [(2, 16, False), (3, 16, True), (64, 24, True),
                                           (64, 0, False)])
def test_delta_gemms_of_enough_rows_leave_sms_free(blas, monkeypatch, rows, sms, free):
    monkeypatch.setattr(config, "DELTA_GEMM_SMS_FREE", (3, sms))
    x = torch.empty(rows, 4, device="meta")
    monkeypatch.setattr(gemm_library, "_on_gpu", lambda t: True)
    with sms_left_free(x):
        inside = (blas["library"], blas["carveout"])
    assert inside == (("cublaslt", sms) if free else ("cublas", None))
    assert (blas["library"], blas["carveout"]) == ("cublas", None)


def test_settings_are_restored_when_the_capture_fails(blas, monkeypatch):
    monkeypatch.setattr(config, "CAPTURE_GEMM_LT_ROWS", (1, 64))
    monkeypatch.setattr(config, "DELTA_GEMM_SMS_FREE", (1, 8))
    blas["carveout"] = 4  # a value someone else set stays
    monkeypatch.setattr(gemm_library, "_on_gpu", lambda t: True)
    with (pytest.raises(RuntimeError, match="capture failed"), rows_library(16, CUDA),
          sms_left_free(torch.empty(16, 4, device="meta"))):
        assert (blas["library"], blas["carveout"]) == ("cublaslt", 8)
        raise RuntimeError("capture failed")
    assert (blas["library"], blas["carveout"]) == ("cublas", 4)


def test_the_runner_captures_each_bucket_under_its_rows(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, rows, device):
            seen.append(rows)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("graphs.runner.rows_library", Recorder)
    runner = make_runtime(tiny(), dtype=torch.float32, device=torch.device("cpu"), slots=2)
    GraphRunner.decode(runner, [1, 4], max_context=16).capture()
    # largest bucket first; LoRA, then base, graphs per bucket
    assert seen == [4, 4, 1, 1]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [3, 8])
def test_replays_captured_under_both_settings_match_eager(monkeypatch, rows):
    """The settings change which kernels run, never what they compute: with cuBLASLt for
    every captured GEMM and the delta route's GEMMs leaving SMs free, bf16 decode replays
    with a mix of adapters match their eager forwards."""
    monkeypatch.setattr(config, "CAPTURE_GEMM_LT_ROWS", (1, 4096))
    monkeypatch.setattr(config, "DELTA_GEMM_SMS_FREE", (1, 16))
    for route in config.DELTA_MAX_ROWS:
        monkeypatch.setitem(config.DELTA_MAX_ROWS, route, 64)
    h = Harness("triton", CUDA, decode_buckets=[rows], max_context=24, slots=3,
                dtype=torch.bfloat16)
    for i, name in enumerate("AB"):
        h.adapter(name, 8, ALL_TARGETS, seed=i)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, h.config.vocab_size, (3,), generator=g).tolist(),
                    (None, "A", "B")[i % 3], 64) for i in range(rows)]
    logits = h.runner.forward_eager(build_extend(reqs, h.runner.kv, CUDA))
    for r, row in zip(reqs, logits, strict=True):
        r.output.append(int(row.argmax()))
    h.step(build_decode(reqs, h.runner.kv, CUDA), expect_bucket=rows)


@pytest.mark.parametrize("text", ["8", "8,16,32", "8,x", ""])
def test_a_malformed_rows_pair_in_the_environment_is_named(monkeypatch, text):
    monkeypatch.setenv("MULTILORA_CAPTURE_GEMM_LT_ROWS", text)
    with pytest.raises(ValueError, match=r"MULTILORA_CAPTURE_GEMM_LT_ROWS=.*two integers"):
        config._int_pair("MULTILORA_CAPTURE_GEMM_LT_ROWS", "0,0")
    monkeypatch.setenv("MULTILORA_CAPTURE_GEMM_LT_ROWS", "33, 64")
    assert config._int_pair("MULTILORA_CAPTURE_GEMM_LT_ROWS", "0,0") == (33, 64)
