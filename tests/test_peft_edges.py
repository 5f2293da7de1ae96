"""Adapters that PEFT itself saved with ``target_parameters`` (a LoRA on a module's weight
parameter rather than on the module) give PEFT's logits: their rank and alpha patterns
match the parameter's name (``...q_proj.weight``), and an embedding weight's lora_A/lora_B
are stored as a delta on the [vocab, hidden] weight, not in PEFT's embedding layout. A folder
that save_pretrained filled with named adapters' subfolders is refused naming them."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from peft_parity import assert_serves_peft_logits, save_random_lora  # noqa: E402

from lora_runtime.lora.adapters import AdapterError  # noqa: E402
from lora_runtime.lora.lora_config import LoRAConfig  # noqa: E402
from lora_runtime.lora.manager import LoRAManager  # noqa: E402
from lora_runtime.model.checkpoint import load_hf_llama  # noqa: E402
from lora_runtime.model.modules import BY_NAME  # noqa: E402

CPU = torch.device("cpu")
PARAMS = ["self_attn.q_proj.weight", "mlp.up_proj.weight"]
CONFIGS = {
    # PEFT matches patterns against "model.layers.0.mlp.up_proj.weight": "up_proj" misses.
    "alpha_pattern by module name": dict(target_parameters=PARAMS,
                                         alpha_pattern={"up_proj": 5}),
    "alpha_pattern by parameter name": dict(target_parameters=PARAMS,
                                            alpha_pattern={"up_proj.weight": 5}),
    "rank_pattern by parameter name": dict(target_parameters=PARAMS,
                                           rank_pattern={"q_proj.weight": 2}),
    "lm_head with alpha_pattern": dict(target_parameters=["lm_head.weight"],
                                       alpha_pattern={"lm_head": 2}),
    "embed_tokens": dict(target_parameters=["model.embed_tokens.weight"]),
}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def base(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=request.param, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "base")
    return root, model


@pytest.mark.parametrize("case", list(CONFIGS))
def test_target_parameters_adapter_gives_peft_s_logits(base, case):
    root, model = base
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], **CONFIGS[case])).eval()
    save_random_lora(pm, root / case)
    assert_serves_peft_logits(pm, root / "base", root / case, 4)


def test_a_folder_of_named_adapters_names_its_subfolders(base):
    """save_pretrained writes an adapter not named "default" into a subfolder of its name:
    loading the folder it was given said only "not a PEFT adapter folder"."""
    root, model = base
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"]),
                             adapter_name="sql")
    pm.save_pretrained(root / "named")
    ours = LoRAManager(load_hf_llama(root / "base", torch.float32, CPU),
                       LoRAConfig(1, 4, tuple(BY_NAME), "torch"))
    with pytest.raises(AdapterError, match=r"not a PEFT adapter folder \(it holds PEFT adapters "
                       r"in subfolders \['sql'\].*pass one of them, e\.g\. .*named/sql\)"):
        ours.load_adapter("sql", root / "named")
    assert not ours.adapters
    ours.load_adapter("sql", root / "named" / "sql")
