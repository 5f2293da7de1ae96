"""The batch-metadata lifecycle (contracts 1-3, 6): None until prepared, reset clears all
per-batch state, idle batches reset, layers gate on lora_active, base-only batches run no LoRA."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.engine.forward_batch import ForwardBatch
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.backends import BACKENDS
from lora_runtime.model.config import tiny

CFG = tiny()


@pytest.fixture(params=["torch", "triton"])
def runner(request):
    r = make_runtime(CFG, dtype=torch.float32, device=DEVICE, backend=request.param, slots=2,
                     max_rank=8, targets=ALL_TARGETS)
    r.lora.load_adapter("a", random_adapter(CFG, "a", 4, ALL_TARGETS, seed=1, b_std=0.3))
    return r


def _lora_batch(runner):
    return build_extend([Request([1, 2, 3], "a"), Request([4], None)], runner.kv, DEVICE)


def test_backend_starts_unprepared_and_reset_restores_every_per_batch_field(runner):
    backend = runner.lora.backend
    fresh = BACKENDS[backend.name](backend.num_slots, DEVICE)
    assert backend.batch_info is None and backend.logits_info is None
    runner.forward_eager(_lora_batch(runner))
    assert backend.batch_info is not None and backend.logits_info is not None
    backend.reset_batch_state()
    for key, value in vars(fresh).items():
        if key == "_eager_layouts":  # a memo keyed by each batch's specs (test_layout_refresh)
            continue
        if value is None or (hasattr(value, "__len__") and len(value) == 0):
            now = getattr(backend, key)
            assert now is None or (hasattr(now, "__len__") and len(now) == 0), (
                f"reset_batch_state left per-batch state {key}={now!r}")


def test_idle_batch_resets_and_idle_forward_runs_no_lora(runner, monkeypatch):
    runner.forward_eager(_lora_batch(runner))
    idle = ForwardBatch.idle(runner.lora, DEVICE)
    assert runner.lora.backend.batch_info is None, "building an idle batch must reset"
    for name in ("linear", "run_embedding", "shrink", "expand"):
        monkeypatch.setattr(runner.lora.backend, name, _forbidden)
    logits = runner.forward_eager(idle)
    assert logits.shape == (0, CFG.vocab_size)


def test_layers_gate_on_lora_active_not_set_lora(runner):
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.set_lora and not layer.lora_active
    runner.lora.prepare_lora_batch(_lora_batch(runner))
    assert layer.lora_active
    runner.lora.reset_lora_batch()
    assert not layer.lora_active
    x = torch.randn(3, CFG.hidden_size, device=DEVICE)
    torch.testing.assert_close(layer(x), layer.base(x))


def test_a_wrapper_with_lora_off_reads_its_base_layer_as_it_is_now(runner):
    """With LoRA off a wrapper computes F.linear on its base's registered weight: a weight
    replaced after wrapping is the one used, and a base that is not a plain nn.Linear runs
    as itself."""
    layer = runner.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.base.in_features, device=DEVICE)
    with torch.no_grad():
        layer.base.weight = torch.nn.Parameter(torch.randn_like(layer.base.weight))
    assert torch.equal(layer(x), x @ layer.base.weight.t())

    class Doubled(torch.nn.Linear):
        def forward(self, v):
            return 2 * super().forward(v)

    odd = Doubled(layer.base.in_features, layer.base.out_features, bias=False, device=DEVICE)
    wrapped = type(layer)(odd, runner.lora.backend, layer.lora)
    torch.testing.assert_close(wrapped(x), 2 * odd.weight.matmul(x.t()).t())


def test_unprepared_backend_refuses_with_the_fix(runner):
    layer = runner.model.model.layers[0].mlp.down_proj
    x = torch.randn(2, CFG.intermediate_size, device=DEVICE)
    with pytest.raises(RuntimeError, match="prepare_lora_batch"):
        runner.lora.backend.linear(layer.base, x, layer.lora)


def test_base_only_batch_runs_no_lora_launch(runner, monkeypatch):
    monkeypatch.setattr(runner.lora.backend, "shrink", _forbidden)
    monkeypatch.setattr(runner.lora.backend, "embedding_shrink", _forbidden)
    batch = build_extend([Request([1, 2]), Request([3])], runner.kv, DEVICE)
    runner.forward_eager(batch)
    assert runner.lora.backend.batch_info is None


def test_stale_metadata_is_caught_not_computed_with(runner):
    """If a caller skips prepare, the previous batch's metadata does not fit this batch and
    the launch refuses, naming the fix, rather than reading out of bounds."""
    reqs = [Request([1, 2, 3], "a")]
    runner.forward_eager(build_extend(reqs, runner.kv, DEVICE))
    reqs[0].output.append(5)
    batch = build_decode(reqs, runner.kv, DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="stale"):
        runner.model(batch, runner.kv)  # the model forward without prepare_lora_batch
    release(reqs, runner.kv)


def _forbidden(*args, **kwargs):
    raise AssertionError("LoRA ran where it must not")


def test_a_repeated_batch_reuses_its_plan_until_a_slot_changes():
    """Consecutive steps of an unchanged batch reuse the last plan (host time of every decode
    step), still moving the LRU clock; once any slot changes hands, the same adapter names
    are planned again: a reused plan would name the slot an adapter held before."""
    runner = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=8)
    lora = runner.lora
    for i, name in enumerate("abc"):
        lora.load_adapter(name, random_adapter(CFG, name, 4, ALL_TARGETS, seed=i))

    def plan(*names):
        reqs = [Request([1, 2], n) for n in names]
        return lora.plan_lora_batch(build_extend(reqs, runner.kv, DEVICE)), reqs

    def touch_b():  # b is used (pinned, then not) without any slot changing hands
        lora.pin_adapter("b")
        lora.pin_adapter("b", False)

    touch_b()
    first, reqs = plan("a", None)
    again, more = plan("a", None)
    assert again is first
    touch_b()
    assert plan("a", None)[0] is first  # reused: it must still make a more recent than b
    lora.reset_lora_batch()
    plan("c")
    assert "b" not in lora.pool.slot_of and {"a", "c"} <= set(lora.pool.slot_of), \
        "a reused plan must touch its adapters (b was the least recently used)"
    lora.reset_lora_batch()
    plan("a", None)
    lora.reset_lora_batch()
    lora.unload_adapter("a")  # its slot is released; a returns under the same name
    lora.load_adapter("a", random_adapter(CFG, "a", 4, ALL_TARGETS, seed=7))
    fresh, _ = plan("a", None)
    assert "a" in lora.pool.slot_of
    assert fresh.rows_spec.request_slots == (lora.pool.slot_of["a"], lora.neutral_slot)
    release(reqs + more, runner.kv)


def test_an_idle_batch_built_before_a_lora_step_runs_no_lora_after_it(runner, monkeypatch):
    """Contract 3 holds for the forward, not only for building the batch: an idle batch kept
    and forwarded after a LoRA step must not read that step's metadata (it raised on it)."""
    idle = ForwardBatch.idle(runner.lora, DEVICE)
    runner.forward_eager(_lora_batch(runner))
    assert runner.lora.backend.batch_info is not None
    for name in ("linear", "run_embedding", "shrink", "expand"):
        monkeypatch.setattr(runner.lora.backend, name, _forbidden)
    logits = runner.forward_eager(idle)
    assert logits.shape == (0, CFG.vocab_size)
    assert runner.lora.backend.batch_info is None


def test_a_runner_built_before_shard_mlp_sees_the_sharded_mlp():
    """``ModelRunner`` read ``model.dp`` once: built before ``shard_mlp``, it took the model as
    unsharded and DPEngine said "call shard_mlp" of a model that was sharded."""
    from lora_runtime.dp.group import DPGroup
    from lora_runtime.dp.shard import shard_mlp
    from lora_runtime.engine.kv_cache import KVCache
    from lora_runtime.engine.model_runner import ModelRunner
    from lora_runtime.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM.random(CFG, torch.float32, DEVICE)
    runner = ModelRunner(model, KVCache(CFG, 16, torch.float32, DEVICE), None)
    assert runner.dp is None
    group = DPGroup(0, 1, None, None, 5.0)  # a group of one, its collectives never called
    shard_mlp(model, group)
    assert runner.dp is group
