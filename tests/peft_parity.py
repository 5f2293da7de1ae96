"""A PEFT model and this runtime serving the adapter PEFT saved: the shared check of the
PEFT-parity tests (last-token logits of two prompts, fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.checkpoint import load_hf_llama
from lora_runtime.model.modules import BY_NAME

CPU = torch.device("cpu")
PROMPTS = [[3, 17, 99, 5], [64, 2, 127, 8, 40, 1]]


def save_random_lora(pm, path: Path) -> None:
    """Random LoRA weights (PEFT starts B at zero: a term of nothing), saved by PEFT."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(path)


def assert_serves_peft_logits(pm, base: Path, adapter: Path, max_rank: int,
                              msg: str | None = None) -> LoRAManager:
    """Loads ``base`` and ``adapter`` here as adapter "a" and checks the logits against
    ``pm``'s; returns the manager."""
    ours = LoRAManager(load_hf_llama(base, torch.float32, CPU),
                       LoRAConfig(1, max_rank, tuple(BY_NAME), "torch"))
    ours.load_adapter("a", adapter)
    runner = ModelRunner(ours.model, KVCache(ours.model.config, 64, torch.float32, CPU), ours)
    reqs = [Request(p, "a", 1) for p in PROMPTS]
    got = runner.forward_eager(build_extend(reqs, runner.kv, CPU))
    release(reqs, runner.kv)
    with torch.no_grad():
        want = torch.stack([pm(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=msg)
    return ours
