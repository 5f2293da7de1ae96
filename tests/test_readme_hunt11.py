"""The README as a contract, eleventh hunt: the manager's own ``pin_adapter`` of an adapter
that is not loaded raised a bare "adapter 'x' is not loaded", naming neither the loaded
adapters nor the fix, where ``Engine.pin_adapter`` and the manager's ``unload_adapter`` name
both; a Triton-backend manager on a bf16 model under the interpreter was built, and its
first LoRA launch refused the dtype mid-step."""

from __future__ import annotations

import pytest
import torch

from kernels.config import interpreted
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.layers import LoRALayer
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.model.config import tiny
from lora_runtime.model.llama import LlamaForCausalLM

CFG = tiny(1)


def test_the_managers_pin_of_an_unknown_adapter_names_the_loaded_ones_and_the_fix():
    model = LlamaForCausalLM.random(CFG, torch.float32, torch.device("cpu"), seed=0)
    lora = LoRAManager(model, LoRAConfig(2, 4, ("q_proj",), "torch"))
    lora.load_adapter("sql", random_adapter(CFG, "sql", 2, ["q_proj"], seed=1))
    for pinned in (True, False):
        with pytest.raises(KeyError, match=r"'chat' is not loaded \(loaded: \['sql'\]\); "
                                           r"load it with load_adapter first"):
            lora.pin_adapter("chat", pinned)
    assert lora.pool.pinned == set() and sorted(lora.adapters) == ["sql"]


@pytest.mark.skipif(not interpreted(), reason="the Triton interpreter's bf16 tl.dot")
def test_a_bf16_model_under_the_interpreter_is_refused_by_a_triton_manager_at_construction():
    """The README: a LoRAConfig(backend="triton") the kernels cannot serve is refused at
    construction, naming backend="torch". Under the interpreter (bf16 tl.dot is wrong) a bf16
    model was wrapped, its adapters loaded and its graphs set up, and the first LoRA launch
    raised mid-step, every later step alike."""
    model = LlamaForCausalLM.random(CFG, torch.bfloat16, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match=r"bf16.*interpreter.*backend='torch'"):
        LoRAManager(model, LoRAConfig(2, 4, ("q_proj",), "triton"))
    assert not any(isinstance(m, LoRALayer) for m in model.modules())
    LoRAManager(model, LoRAConfig(2, 4, ("q_proj",), "torch"))  # the fix it names serves


def test_an_empty_adapter_name_is_refused_leaving_the_pool_as_it_was():
    from runtime_helpers import ALL_TARGETS, make_runtime

    from lora_runtime.lora.adapters import AdapterError, random_adapter
    from lora_runtime.model.config import tiny

    cfg = tiny(1)
    r = make_runtime(cfg, dtype=torch.float32, device=torch.device("cpu"), backend="torch",
                     slots=2, max_rank=8, targets=ALL_TARGETS)
    for name in ("", "  "):
        with pytest.raises(AdapterError, match="must not be empty"):
            r.lora.load_adapter(name, random_adapter(cfg, "a", 4, ALL_TARGETS, seed=1))
    assert r.lora.adapters == {}
