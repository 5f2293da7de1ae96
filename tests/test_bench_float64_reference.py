"""The base-step suite verified a replay against the eager forward of the same runtime, so a
fault in the base math both share (an RMSNorm eps, a RoPE base, a cache slot read for another
request) was verified and timed. Its rows are now also checked against a float64 decode step
written from the definition (``bench.float64_model``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_helpers import drawn_adapter, make_runtime

from bench import base_step_suite, profiles
from bench.context import Context
from bench.float64_model import Probe, last_logits_f64
from bench.hardware import Ceilings
from bench.reference_checks import check_decode_rows
from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.model import layers
from lora_runtime.model.backend import use_base_backend
from lora_runtime.model.config import PRESETS
from lora_runtime.model.llama import LlamaForCausalLM

CPU = torch.device("cpu")
# GQA 2:1, head_dim 8 and the llama3 frequency scaling (with a short original context, so
# every band of it is used by 64 positions).
CONFIG = dataclasses.replace(
    PRESETS["tiny"](2), max_position_embeddings=128,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")


def _decode(context_lengths, wrong_slot: bool = False):
    """A decode step of requests with these context lengths over a noise-filled cache, run
    eagerly with the torch kernels. ``wrong_slot``: the runtime reads the last request's
    first context slot from the first request's (the reference reads the right one)."""
    model = LlamaForCausalLM.random(CONFIG, torch.float32, CPU, seed=3)
    kv = KVCache(CONFIG, sum(context_lengths) + 8, torch.float32, CPU)
    for cache in kv.k + kv.v:
        cache.normal_()
    reqs = [Request([1] * n, None, 4) for n in context_lengths]
    for r in reqs:
        r.kv_slots = kv.alloc(len(r.prompt) - 1)
    own = list(reqs[-1].kv_slots)
    if wrong_slot:
        reqs[-1].kv_slots = [reqs[0].kv_slots[0], *own[1:]]
    batch = build_decode(reqs, kv, CPU)
    with use_base_backend("torch"):
        got = ModelRunner(model, kv, None).forward_eager(batch)
    reqs[-1].kv_slots = [*own, reqs[-1].kv_slots[-1]]
    return model, kv, reqs, got


def test_the_float64_step_equals_the_runtime():
    model, kv, reqs, got = _decode([5, 40, 64])
    ref = last_logits_f64(model, [Probe((r.last_token,), tuple(r.kv_slots[:-1])) for r in reqs],
                          kv)
    err = ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-5
    assert check_decode_rows(model, kv, reqs, got, torch.float32, "x") < 1e-5


@pytest.mark.parametrize("fault", ["eps", "theta", "slot"])
def test_a_shared_base_fault_fails(monkeypatch, fault):
    if fault == "eps":
        real = layers.RMSNorm.forward

        def eps_off(self, *a, **k):
            self.eps, saved = self.eps * 100 + 1e-3, self.eps
            try:
                return real(self, *a, **k)
            finally:
                self.eps = saved

        monkeypatch.setattr(layers.RMSNorm, "forward", eps_off)
    elif fault == "theta":
        monkeypatch.setattr(layers, "inverse_frequencies", _theta_doubled)
    model, kv, reqs, got = _decode([5, 40, 64], wrong_slot=fault == "slot")
    with pytest.raises(AssertionError, match="float64 decode step"):
        check_decode_rows(model, kv, reqs, got, torch.float32, "x")


def _theta_doubled(cfg):
    d = cfg.head_dim
    return 1.0 / (2 * cfg.rope_theta) ** (torch.arange(0, d, 2).float() / d)


def test_the_suite_records_the_float64_error(monkeypatch):
    case = base_step_suite.cases("tiny", 1, "float32", (3,), (16,), ("torch",))[0]
    row = base_step_suite.make_runner([case], CTX)(case)[0]
    v = row["verification"]
    assert v["status"] == "verified" and v["max_rel_err_vs_float64"] < 1e-5
    monkeypatch.setattr(layers, "inverse_frequencies", _theta_doubled)
    row = base_step_suite.make_runner([case], CTX)(case)[0]
    assert row["verification"]["status"] == "failed"
    assert "float64 decode step" in row["verification"]["error"] and row["stats"] is None


def test_the_cpu_profile_checks_the_triton_base_kernels(monkeypatch):
    """The CPU profile's base step runs the Triton kernels too (the interpreter, fp32): a fault
    inside one (the Triton norm's eps x100) fails their case, and the torch case beside it
    stays verified."""
    cases = {c.kernels: c for c in profiles.base_step_cases("cpu") if c.batch_size == 3}
    real = layers.rms_norm
    monkeypatch.setattr(layers, "rms_norm",
                        lambda x, w, eps, *args: real(x, w, eps * 100, *args))
    for kernels, want in (("triton", "failed"), ("torch", "verified")):
        row = base_step_suite.make_runner([cases[kernels]], CTX)(cases[kernels])[0]
        assert row["verification"]["status"] == want, (kernels, row["verification"]["error"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_float64_model_with_adapters_equals_the_runtime(tied):
    """Every target (embed_tokens and lm_head included), drawn ranks, alphas and rsLoRA, a
    base request among them: one prefill batch of the runtime against each request alone."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    runner = make_runtime(config, dtype=torch.float32, device=CPU, seed=5)
    adapters = {f"a{i}": drawn_adapter(config, f"a{i}", 11 + i, 8) for i in range(3)}
    for name, a in adapters.items():
        runner.lora.load_adapter(name, a)
    g = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(0, config.vocab_size, (n,), generator=g).tolist(), name, 1)
            for n, name in ((7, "a0"), (3, None), (12, "a1"), (5, "a2"), (9, "a0"))]
    got = runner.forward_eager(build_extend(reqs, runner.kv, CPU))
    release(reqs, runner.kv)
    ref = last_logits_f64(runner.model, [Probe(tuple(r.prompt), (), adapters.get(r.adapter))
                                         for r in reqs])
    err = ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-5
    assert {t for a in adapters.values() for t in a.targets} >= {"embed_tokens", "lm_head"}
