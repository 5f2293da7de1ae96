"""Adapters and LoRA layers, seventh hunt: a base layer swapped into a wrapper after wrapping
(a quantizing pass) ran as the nn.Linear it replaced; a LoRAManager whose slot buffers could
not all be allocated left the model half-wrapped, refusing every later manager; a hand-built
adapter whose rank_pattern or alpha_pattern was None failed its load and its save with bare
TypeError / AttributeError."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_helpers import make_runtime

from kernels import LoRAWeights
from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import (
    AdapterError,
    load_peft_adapter,
    random_adapter,
    save_peft_adapter,
)
from lora_runtime.lora.layers import LoRALayer
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CFG = tiny(1)
CPU = torch.device("cpu")


class _Doubled(torch.nn.Linear):
    def forward(self, v):
        return 2 * super().forward(v)


def test_a_base_swapped_after_wrapping_runs_as_itself():
    """The wrapper decided at construction that its base was a plain nn.Linear and called
    F.linear on the weight of whatever base it held later: a base swapped in afterwards (a
    quantized or hooked layer, set on the wrapper by a pass over named_modules) was skipped,
    silently, with LoRA off and on."""
    r = make_runtime(CFG, dtype=torch.float32, device=CPU, slots=1, max_rank=4)
    layer = r.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.base.in_features)
    layer.base = _Doubled(layer.base.in_features, layer.base.out_features, bias=False)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.base(x))
    r.lora.load_adapter("a", random_adapter(CFG, "a", 4, ("down_proj",), seed=1, b_std=0.3))
    reqs = [Request([1, 2, 3], "a")]
    r.lora.prepare_lora_batch(build_extend(reqs, r.kv, CPU))
    with torch.no_grad():
        with_lora = layer(x)
        r.lora.reset_lora_batch()
        delta = with_lora - layer.base(x)
    release(reqs, r.kv)
    m = r.lora.adapters["a"].modules[(0, "down_proj")]
    torch.testing.assert_close(delta, m.scaling * (x @ m.a.t() @ m.b.t()), rtol=1e-4, atol=1e-4)


def test_a_manager_that_cannot_allocate_its_slots_leaves_the_model_unwrapped(monkeypatch):
    """Out of memory allocating the embedding's slots (the last and largest buffer) left every
    linear layer wrapped: a second manager with a smaller pool was then refused ("already has
    LoRA layers ... build one on a fresh model"), a checkpoint to load again."""
    model = LlamaForCausalLM.random(CFG, torch.float32, CPU, seed=0)
    real = LoRAWeights.for_embedding

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(LoRAWeights, "for_embedding", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        LoRAManager(model, LoRAConfig(4, 8, ("q_proj", "embed_tokens"), "torch"))
    assert not any(isinstance(m, LoRALayer) for m in model.modules())
    monkeypatch.setattr(LoRAWeights, "for_embedding", real)
    lora = LoRAManager(model, LoRAConfig(2, 8, ("q_proj", "embed_tokens"), "torch"))
    assert {k[1] for k in lora.weights} == {"qkv_proj", "embed_tokens"}


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_hand_built_adapter_without_patterns_loads_and_saves(tmp_path, field):
    """``rank_pattern=None`` (PEFT's ``LoraConfig`` field is Optional, and a config's null
    already read as no patterns) raised a bare "'NoneType' object is not iterable" from the
    load's dtype cast and "'NoneType' object has no attribute 'values'" from
    ``save_peft_adapter``. None is no pattern; a pattern that is not a dict is refused
    naming the field, and saving computes the patterns from the modules instead."""
    r = make_runtime(CFG, dtype=torch.float32, device=CPU, slots=1, max_rank=8)
    ad = random_adapter(CFG, "a", 4, ("q_proj", "o_proj"), seed=1)
    r.lora.load_adapter("a", dataclasses.replace(ad, **{field: None}))
    save_peft_adapter(dataclasses.replace(ad, **{field: None}), tmp_path / "none")
    save_peft_adapter(dataclasses.replace(ad, **{field: ["q_proj"]}), tmp_path / "list")
    for path in ("none", "list"):
        back = load_peft_adapter(tmp_path / path)
        assert {k: m.scaling for k, m in back.modules.items()} == {
            k: m.scaling for k, m in ad.modules.items()}
    with pytest.raises(AdapterError, match=f"adapter 'b': {field} must be a dict of module "
                                           "regex"):
        r.lora.load_adapter("b", dataclasses.replace(ad, name="b", **{field: ["q_proj"]}))
    assert sorted(r.lora.adapters) == ["a"]
