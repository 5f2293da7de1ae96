"""The model suite's verification must see a LoRA fault that graph and eager share: a runtime
whose slots hold a scaling 2% off, or no o_proj term, or no v slice of qkv, still replays
what its eager forward computes, so "replay == eager" passed it as verified (and timed it).
The eager logits are now also checked against each request run alone through the float64
model written from the definition, with its adapter (``bench.reference_checks``)."""

from __future__ import annotations

import pytest
import torch

from bench.context import Context
from bench.hardware import Ceilings
from bench.model_bench import ModelCase, RuntimeCache, run_case
from bench.reference_checks import LORA_CHECK
from lora_runtime.lora.slot_image import SlotImage
from lora_runtime.model.modules import SLICES

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")
CASE = ModelCase("decode", "tiny", 2, 16, 4, 2, (4, 8), "torch", torch.float32)
PREFILL = ModelCase("prefill", "tiny", 2, 16, 2, 2, (4, 8), "torch", torch.float32)


def _scaling_off(image, module, s, pos):
    image.scalings[pos] *= 1.02


def _no_o_proj(image, module, s, pos):
    if module == "o_proj":
        image.ranks[pos] = 0


def _no_v_slice(image, module, s, pos):
    if module == "qkv_proj" and s == 2:
        image.ranks[pos] = 0


@pytest.mark.parametrize("case", [CASE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("fault", [_scaling_off, _no_o_proj, _no_v_slice])
def test_a_lora_fault_shared_by_graph_and_eager_fails_the_case(monkeypatch, case, fault):
    real = SlotImage.pack

    def pack(adapter, weights, local_weights, dtype, pin):
        """The slot image as written into the slots every path reads, with the fault."""
        image = real(adapter, weights, local_weights, dtype, pin)
        pos = 0
        for (_, module) in weights:
            for s in range(len(SLICES[module])):
                fault(image, module, s, pos)
                pos += 1
        return image

    monkeypatch.setattr(SlotImage, "pack", staticmethod(pack))
    rows = run_case(case, CTX, RuntimeCache([case], CPU))
    assert len(rows) == 1, [r["verification"] for r in rows]
    v = rows[0]["verification"]
    assert v["status"] == "failed" and "float64 model with its adapter" in v["error"]
    assert rows[0]["stats"] is None


def test_a_correct_runtime_passes_the_float64_reference():
    rows = run_case(CASE, CTX, RuntimeCache([CASE], CPU))
    lora = [r for r in rows if r["traffic"] == "lora"]
    assert lora and all(r["verification"]["status"] == "verified" for r in rows)
    v = lora[0]["verification"]
    assert v["max_rel_err_lora_term_vs_float64"] < 1e-4
    assert v["lora_term_rel_size"] > 1e-3  # the term is there to be checked
    assert LORA_CHECK in v["checks"]
