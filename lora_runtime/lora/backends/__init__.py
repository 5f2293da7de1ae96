import torch

from kernels.config import interpreted
from lora_runtime.lora.backends.base import LoRABackend, LoRAGraphBuffers, RowSet
from lora_runtime.lora.backends.torch_backend import TorchBackend
from lora_runtime.lora.backends.triton_backend import TritonBackend

BACKENDS = {"triton": TritonBackend, "torch": TorchBackend}


def make_backend(name: str, num_slots: int, device) -> LoRABackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "triton" and torch.device(device).type != "cuda" and not interpreted():
        raise ValueError(
            f"LoRA backend 'triton' on {device}: compiled Triton kernels cannot read host "
            "memory. Use LoRAConfig(backend='torch') on a CPU, or set TRITON_INTERPRET=1 "
            "before importing kernels (the interpreter is slow)")
    return BACKENDS[name](num_slots, device)


__all__ = [
    "BACKENDS",
    "LoRABackend",
    "LoRAGraphBuffers",
    "RowSet",
    "TorchBackend",
    "TritonBackend",
    "make_backend",
]
