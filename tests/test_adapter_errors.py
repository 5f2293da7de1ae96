"""Bad input gets a clear error and leaves the pool exactly as it was."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import DEVICE
from runtime_helpers import make_runtime
from safetensors.torch import load_file, save_file

from lora_runtime.engine.requests import Request, build_extend
from lora_runtime.lora.adapters import AdapterError, random_adapter, save_peft_adapter
from lora_runtime.model.config import tiny

CFG = tiny()


@pytest.fixture
def runner():
    r = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=8,
                     targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"))
    r.lora.load_adapter("resident", random_adapter(CFG, "resident", 4, seed=1), pinned=True)
    r.lora.load_adapter("other", random_adapter(CFG, "other", 8, seed=2))
    return r


def _snapshot(lora):
    return (
        sorted(lora.adapters), sorted(lora.images), list(lora.pool.owner), dict(lora.pool.slot_of),
        set(lora.pool.pinned),
        [(w.lora_a.clone(), w.lora_b.clone(), w.ranks.clone(), w.scalings.clone())
         for w in lora.weights.values()],
        lora.backend.batch_info,
    )


def _assert_unchanged(lora, before):
    after = _snapshot(lora)
    assert after[:5] == before[:5]
    for (a0, b0, r0, s0), (a1, b1, r1, s1) in zip(before[5], after[5], strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)
        assert torch.equal(r0, r1) and torch.equal(s0, s1)
    assert after[6] is before[6]


def _saved(tmp_path, **kw):
    ad = random_adapter(CFG, "x", 4, seed=3, **kw)
    save_peft_adapter(ad, tmp_path / "x")
    return tmp_path / "x"


def _without(name):
    def make(tmp):
        path = _saved(tmp)
        (path / name).unlink()
        return path
    return make


def _overwrite(name, data: bytes):
    def make(tmp):
        path = _saved(tmp)
        (path / name).write_bytes(data)
        return path
    return make


def _truncated(tmp):
    path = _saved(tmp)
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a copy cut short
    return path


CASES = {
    "missing folder": (lambda p: p / "nope", "not a directory"),
    "missing config": (_without("adapter_config.json"), "adapter_config.json is missing"),
    "missing weights": (_without("adapter_model.safetensors"),
                        "adapter_model.safetensors is missing"),
    "corrupt config": (_overwrite("adapter_config.json", b"{r: 4,"), "not valid JSON"),
    "corrupt weights": (_overwrite("adapter_model.safetensors", b"\x10\x00\x00\x00garbage"),
                        "could not be read"),
    "truncated weights": (_truncated, "adapter_model.safetensors could not be read"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_files(runner, tmp_path, case):
    make, msg = CASES[case]
    path = make(tmp_path)
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=msg):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


def _edit_weights(path, fn):
    f = path / "adapter_model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def test_rank_above_max_rank(runner):
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=r"rank 16 exceeds max_rank 8.*max_rank>=16"):
        runner.lora.load_adapter("big", random_adapter(CFG, "big", 16))
    _assert_unchanged(runner.lora, before)


def test_target_modules_naming_no_llama_module(runner, tmp_path):
    path = _saved(tmp_path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    own = cfg["target_modules"]
    cfg["target_modules"] = ["c_attn", "attn_out"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="names no module of a Llama model"):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)
    # Other architectures' names beside the right ones are ignored, as PEFT does.
    cfg["target_modules"] = [*own, "c_attn", "query_key_value"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    runner.lora.load_adapter("x", path)


def test_target_not_enabled_in_runtime(runner):
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="without LoRA on 'lm_head'.*target_modules"):
        runner.lora.load_adapter("h", random_adapter(CFG, "h", 4, ("lm_head",)))
    _assert_unchanged(runner.lora, before)


def test_shape_mismatch(runner, tmp_path):
    path = _saved(tmp_path)
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"
    _edit_weights(path, lambda t: t.__setitem__(key, torch.randn(63, 4)))
    before = _snapshot(runner.lora)
    msg = r"o_proj: lora_B has shape \(63, 4\), expected \(64, 4\)"
    with pytest.raises(AdapterError, match=msg):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights(runner, tmp_path, bad):
    path = _saved(tmp_path)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"

    def poison(t):
        t[key][2, 5] = bad

    _edit_weights(path, poison)
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="down_proj: lora_A contains NaN or Inf"):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


def test_weights_beyond_the_models_dtype():
    """Finite in the adapter's own float32, infinite once cast to the model's float16."""
    r = make_runtime(CFG, dtype=torch.float16, device=DEVICE, slots=2, max_rank=8,
                     targets=("o_proj",))
    r.lora.load_adapter("resident", random_adapter(CFG, "resident", 4, ("o_proj",), seed=1),
                        pinned=True)
    ad = random_adapter(CFG, "big", 4, ("o_proj",), seed=3)
    ad.modules[(1, "o_proj")].b[0, 0] = 7e4
    before = _snapshot(r.lora)
    with pytest.raises(AdapterError, match=r"layers\.1\..*o_proj: lora_B holds values beyond "
                                           r"torch\.float16's range"):
        r.lora.load_adapter("big", ad)
    _assert_unchanged(r.lora, before)


def test_scaling_beyond_float32(runner):
    ad = random_adapter(CFG, "big", 4, ("o_proj",), seed=3)
    ad.modules[(0, "o_proj")].scaling = 1e39  # a finite Python float, inf in the kernels
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="scaling 1e\\+39 does not fit float32"):
        runner.lora.load_adapter("big", ad)
    _assert_unchanged(runner.lora, before)


def test_duplicate_name(runner):
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="already loaded"):
        runner.lora.load_adapter("other", random_adapter(CFG, "other", 2))
    _assert_unchanged(runner.lora, before)


def test_batch_naming_an_adapter_not_loaded(runner):
    before = _snapshot(runner.lora)
    reqs = [Request([1, 2], "resident"), Request([3], "ghost")]
    batch = build_extend(reqs, runner.kv, DEVICE)
    with pytest.raises(KeyError, match=r"not loaded: \['ghost'\].*load_adapter"):
        runner.lora.prepare_lora_batch(batch)
    _assert_unchanged(runner.lora, before)


def test_more_distinct_adapters_than_slots(runner):
    runner.lora.load_adapter("third", random_adapter(CFG, "third", 2, seed=4))
    before = _snapshot(runner.lora)
    reqs = [Request([1], n) for n in ("resident", "other", "third")]
    with pytest.raises(RuntimeError, match="3 distinct adapters but the pool has 2 slots"):
        runner.lora.prepare_lora_batch(build_extend(reqs, runner.kv, DEVICE))
    _assert_unchanged(runner.lora, before)


def test_no_slot_left_because_of_pins_and_batch(runner):
    runner.lora.load_adapter("third", random_adapter(CFG, "third", 2, seed=4))
    runner.lora.prepare_lora_batch(build_extend([Request([1], "other")], runner.kv, DEVICE))
    runner.lora.pin_adapter("other")
    before = _snapshot(runner.lora)
    with pytest.raises(RuntimeError, match="every slot holds an adapter of this batch or a pinned"):
        runner.lora.prepare_lora_batch(build_extend([Request([2], "third")], runner.kv, DEVICE))
    _assert_unchanged(runner.lora, before)


def test_unsupported_peft_features(runner, tmp_path):
    for key, value, msg in (("use_dora", True, "DoRA"),
                            ("modules_to_save", ["lm_head"], "modules_to_save"),
                            ("alora_invocation_tokens", [5, 6], "activated LoRA"),
                            ("lora_bias", True, "a bias on lora_B"),
                            ("use_bdlora", True, "BD-LoRA"),
                            ("init_lora_weights", "pissa_niter_4", "path_initial_model"),
                            ("init_lora_weights", "olora", "changed base weight")):
        path = _saved(tmp_path / key)
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg[key] = value
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(AdapterError, match=msg):
            runner.lora.load_adapter("x", path)
    assert "x" not in runner.lora.adapters


def test_unloading_an_adapter_of_the_prepared_batch_is_refused(runner):
    runner.lora.prepare_lora_batch(build_extend([Request([1], "other")], runner.kv, DEVICE))
    with pytest.raises(RuntimeError, match="used by the prepared batch"):
        runner.lora.unload_adapter("other")
    runner.lora.reset_lora_batch()
    runner.lora.unload_adapter("other")
    assert "other" not in runner.lora.adapters and "other" not in runner.lora.pool.slot_of


def test_a_second_manager_on_a_wrapped_model_is_refused():
    """A second LoRAManager on the same model wrapped the wrappers: loading an lm_head
    adapter then failed with an AttributeError deep in the layers."""
    from lora_runtime.lora.lora_config import LoRAConfig
    from lora_runtime.lora.manager import LoRAManager
    from lora_runtime.model.config import PRESETS
    from lora_runtime.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM.random(PRESETS["tiny"](1), torch.float32, torch.device("cpu"))
    first = LoRAManager(model, LoRAConfig(2, 4, backend="torch"))
    with pytest.raises(ValueError, match="already has LoRA layers.*fresh model"):
        LoRAManager(model, LoRAConfig(2, 4, backend="torch"))
    assert first.model is model and not first.adapters


@pytest.mark.parametrize("source", [None, 7, {"q_proj.lora_A": torch.zeros(1)}, b"/tmp/x"],
                         ids=["None", "int", "state dict", "bytes"])
def test_a_source_that_is_neither_a_folder_nor_an_adapter_is_refused(runner, source):
    """A state dict or None raised Path's TypeError ("expected str, bytes or os.PathLike
    object"), naming neither the argument nor what it takes."""
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="source must be a PEFT adapter folder.*or a "
                       "LoRAAdapter, got " + type(source).__name__):
        runner.lora.load_adapter("x", source)
    _assert_unchanged(runner.lora, before)


@pytest.mark.parametrize("modules", [[], ((0, "o_proj"),)], ids=["list", "tuple"])
def test_modules_that_are_not_a_dict_are_refused(runner, modules):
    import dataclasses

    ad = dataclasses.replace(random_adapter(CFG, "x", 2, ("o_proj",)), modules=modules)
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="modules must be a dict"):
        runner.lora.load_adapter("x", ad)
    _assert_unchanged(runner.lora, before)


@pytest.mark.parametrize("name", [None, 7, ("a",)])
def test_a_name_that_is_not_a_string_is_refused(runner, name):
    """None is the base model's adapter name in a request: a pinned adapter loaded under it
    took the neutral slot's place, and a base-model row of a batch with adapters was served
    with its weights (logits off by ~1.7)."""
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="adapter name must be a string.*got " +
                       re.escape(repr(name))):
        runner.lora.load_adapter(name, random_adapter(CFG, "x", 2, seed=5), pinned=True)
    _assert_unchanged(runner.lora, before)


def test_two_keys_for_one_tensor_are_refused(runner, tmp_path):
    """PEFT's key with and without the adapter name (``.default``): one of the two was served,
    whichever the file listed last, silently."""
    path = _saved(tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_weights(path, lambda t: t.__setitem__(key.replace(".weight", ".default.weight"),
                                                t[key] * 100))
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=r"q_proj\.lora_A\.default\.weight.*"
                                           r"q_proj\.lora_A\.weight.*the same tensor"):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_weights_that_are_not_floating_point_are_refused(runner, tmp_path, dtype):
    """An int8 (quantized) or bool lora_A was cast to the model's dtype and served as if its
    integers were the weights."""
    path = _saved(tmp_path)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    _edit_weights(path, lambda t: t.__setitem__(key, (t[key] * 10).to(dtype)))
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=r"v_proj: lora_A has dtype " + re.escape(str(dtype))
                       + ".*floating point"):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


def test_float8_weights_load_as_their_values(runner, tmp_path):
    """The finiteness check raised NotImplementedError ("isfinite" not implemented for
    Float8_e4m3fn) instead of loading or refusing."""
    path = _saved(tmp_path)
    _edit_weights(path, lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()}))
    runner.lora.load_adapter("x", path)
    want = load_file(str(path / "adapter_model.safetensors"))
    got = runner.lora.adapters["x"].modules[(1, "v_proj")]
    assert torch.equal(got.a, want["base_model.model.model.layers.1.self_attn.v_proj"
                                    ".lora_A.weight"].float())


Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


@pytest.mark.parametrize("gone", ["A", "B"])
def test_a_module_missing_lora_a_or_b(runner, tmp_path, gone):
    path = _saved(tmp_path)
    _edit_weights(path, lambda t: t.pop(Q.format(gone)))
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=rf"layers\.0\.self_attn\.q_proj: lora_{gone} is "
                                           r"missing from adapter_model\.safetensors.*save the "
                                           "adapter again"):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


RANK_FAULTS = {  # lora_A rank, lora_B rank, message
    "A and B ranks differ": (4, 3, r"lora_A \(4, 64\) has rank 4 but lora_B \(64, 3\) has rank "
                                   r"3 .*save the adapter again"),
    "rank other than the config's": (
        3, 3, r"lora_A \(3, 64\) / lora_B \(64, 3\) have rank 3, but adapter_config\.json "
              "gives this module rank 4: set r, or a rank_pattern entry for it"),
}


@pytest.mark.parametrize("case", list(RANK_FAULTS))
def test_weights_whose_rank_disagrees(runner, tmp_path, case):
    ra, rb, msg = RANK_FAULTS[case]
    path = _saved(tmp_path)
    _edit_weights(path, lambda t: t.update({Q.format("A"): torch.randn(ra, 64),
                                            Q.format("B"): torch.randn(64, rb)}))
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj: " + msg):
        runner.lora.load_adapter("x", path)
    _assert_unchanged(runner.lora, before)


EMBED_BASE = "base_model.model.model.embed_tokens.base_layer.weight"


@pytest.fixture
def embed_runner():
    r = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=8,
                     targets=("o_proj", "embed_tokens"))
    r.lora.load_adapter("resident", random_adapter(CFG, "resident", 4, ("o_proj",), seed=1),
                        pinned=True)
    return r


def _with_base_embeddings(tmp_path, runner, make):
    path = tmp_path / "e"
    save_peft_adapter(random_adapter(CFG, "e", 4, ("embed_tokens",), seed=5), path)
    base = runner.model.model.embed_tokens.base.weight.detach().cpu()
    _edit_weights(path, lambda t: t.__setitem__(EMBED_BASE, make(base.clone())))
    return path


def _poisoned(w):
    w[3, 7] = float("nan")
    return w


BASE_FAULTS = {
    "int8": (lambda w: (w * 100).to(torch.int8), r"has dtype torch\.int8, not floating point"),
    "bool": (lambda w: w > 0, r"has dtype torch\.bool, not floating point"),
    "NaN": (_poisoned, "contains NaN or Inf"),
}


@pytest.mark.parametrize("case", list(BASE_FAULTS))
def test_saved_base_embeddings_that_are_not_float_weights(embed_runner, tmp_path, case):
    """An int8 (quantized) copy raised a bare TypeError from torch.finfo; a NaN one was
    reported as weights that differ from the model's."""
    make, msg = BASE_FAULTS[case]
    path = _with_base_embeddings(tmp_path, embed_runner, make)
    before = _snapshot(embed_runner.lora)
    with pytest.raises(AdapterError, match=r"adapter 'e', model\.embed_tokens\.base_layer\."
                                           r"weight " + msg + ".*save_embedding_layers=False"):
        embed_runner.lora.load_adapter("e", path)
    _assert_unchanged(embed_runner.lora, before)


def test_saved_base_embeddings_on_a_quantized_model_layer(embed_runner, tmp_path):
    """The model's embed_tokens in int8: torch.finfo raised a bare TypeError."""
    path = _with_base_embeddings(tmp_path, embed_runner, lambda w: w)
    emb = embed_runner.lora.model.model.embed_tokens.base
    emb.weight = torch.nn.Parameter((emb.weight.detach() * 100).to(torch.int8),
                                    requires_grad=False)
    before = _snapshot(embed_runner.lora)
    with pytest.raises(AdapterError, match=r"the model's embed_tokens weight has dtype "
                                           r"torch\.int8 \(a quantized layer\).*floating dtype"):
        embed_runner.lora.load_adapter("e", path)
    _assert_unchanged(embed_runner.lora, before)


V, H = CFG.vocab_size, CFG.hidden_size
BAD_BASE_LAYERS = {
    "meta tensor": ({"embed_tokens": torch.empty(V, H, device="meta")},
                    r"base_layers\['embed_tokens'\] must be a tensor with data, got a meta"),
    "a linear target": ({"q_proj": torch.zeros(V, H)},
                        r"base_layers key 'q_proj' is not one of \['embed_tokens', 'lm_head'\]"),
    "not a tensor": ({"lm_head": [[0.0]]}, r"base_layers\['lm_head'\] must be a tensor with "
                                          "data, got list"),
    "not a dict": ([("embed_tokens", torch.zeros(V, H))], "base_layers must be a dict"),
}


@pytest.mark.parametrize("case", list(BAD_BASE_LAYERS))
def test_hand_built_base_layers_that_are_not_base_weights(runner, case):
    """A LoRAAdapter's base_layers were read as tensors of embed_tokens / lm_head: a meta
    tensor, another key, a list or a list of pairs raised bare RuntimeError, KeyError or
    AttributeError."""
    import dataclasses

    layers, msg = BAD_BASE_LAYERS[case]
    ad = dataclasses.replace(random_adapter(CFG, "x", 2, ("o_proj",)), base_layers=layers)
    before = _snapshot(runner.lora)
    with pytest.raises(AdapterError, match="adapter 'x'.*" + msg):
        runner.lora.load_adapter("x", ad)
    _assert_unchanged(runner.lora, before)
