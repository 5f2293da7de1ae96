"""CPU tensors on a machine whose Triton compiles (a GPU machine without the interpreter):
the base step falls back to the torch kernels, and a Triton LoRA backend there is refused
with the fix, instead of a launch failing on a host pointer mid-forward."""

from __future__ import annotations

import pytest
import torch

import lora_runtime.lora.backends as lora_backends
import lora_runtime.model.backend as model_backend
from lora_runtime.lora.backends import make_backend
from lora_runtime.model.backend import base_backend, use_base_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("interpreting", [True, False])
def test_the_base_step_runs_triton_on_cpu_tensors_only_under_the_interpreter(
        interpreting, monkeypatch):
    monkeypatch.setattr(model_backend, "interpreted", lambda: interpreting)
    with use_base_backend("triton"):
        assert base_backend(CUDA) == "triton"
        assert base_backend(CPU) == ("triton" if interpreting else "torch")
        assert base_backend() == "triton"
    with use_base_backend("torch"):
        assert base_backend(CUDA) == base_backend(CPU) == "torch"


def test_a_triton_lora_backend_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(lora_backends, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="backend='torch'.*TRITON_INTERPRET=1"):
        make_backend("triton", 4, "cpu")
    assert make_backend("torch", 4, "cpu").name == "torch"
    monkeypatch.setattr(lora_backends, "interpreted", lambda: True)
    assert make_backend("triton", 4, "cpu").name == "triton"
