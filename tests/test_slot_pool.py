"""LRU eviction: never an adapter of the batch being prepared, never a pinned one; a reloaded
adapter in another slot still computes with its own weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from runtime_helpers import make_runtime, merged_model, reference_logits

from lora_runtime.engine.requests import Request, build_extend, release
from lora_runtime.lora.adapters import random_adapter
from lora_runtime.lora.slot_pool import SlotPool, SlotPoolError
from lora_runtime.model.config import tiny

CFG = tiny()


def test_lru_order_pins_and_batch_members():
    pool = SlotPool(2)
    for names in (["a"], ["b"]):
        for slot, name, _ in pool.plan(names):
            pool.assign(slot, name)
        pool.touch(names)
    [(slot, name, evicted)] = pool.plan(["c"])
    assert (name, evicted) == ("c", "a"), "a is least recently used"
    pool.pinned.add("a")
    [(_, _, evicted)] = pool.plan(["c"])
    assert evicted == "b", "a pinned: b goes instead"
    with pytest.raises(SlotPoolError, match="every slot holds"):
        pool.plan(["b", "c"])  # b is in this batch, a is pinned: c has nowhere to go
    with pytest.raises(SlotPoolError, match="3 distinct adapters"):
        pool.plan(["a", "b", "c"])
    assert pool.owner == ["a", "b"], "plan() changes nothing"
    pool.pinned.clear()
    with pytest.raises(SlotPoolError, match="every slot holds"):
        pool.plan(["c"], protected=["a", "b"])  # both serve a prepared batch


def test_evicted_and_reloaded_adapter_uses_its_own_weights():
    runner = make_runtime(CFG, dtype=torch.float32, device=DEVICE, backend="triton", slots=2,
                          max_rank=8)
    ads = {n: random_adapter(CFG, n, 2 + 2 * i, seed=i, b_std=0.3)
           for i, n in enumerate(["a", "b", "c"])}
    for n, ad in ads.items():
        runner.lora.load_adapter(n, ad)
    prompt = [3, 1, 4, 1, 5]
    for order in (["a", "b"], ["c"], ["a"], ["b", "c"], ["a"]):
        reqs = [Request(prompt, n) for n in order]
        logits = runner.forward_eager(build_extend(reqs, runner.kv, DEVICE))
        release(reqs, runner.kv)
        for n, row in zip(order, logits, strict=True):
            ref = reference_logits(merged_model(runner.model, ads[n]), prompt, torch.float32,
                                   DEVICE)
            torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4, msg=f"{order}: {n}")
    assert set(runner.lora.pool.slot_of) <= {"a", "b", "c"}


def test_a_pinned_load_with_every_slot_pinned_is_refused_and_changes_nothing():
    from lora_runtime.lora.adapters import AdapterError

    runner = make_runtime(tiny(1), dtype=torch.float32, device="cpu", slots=2, max_rank=8)
    lora = runner.lora
    ads = [random_adapter(lora.model.config, n, 4, ["q_proj"], seed=i, b_std=0.3)
           for i, n in enumerate("abc")]
    for ad in ads[:2]:
        lora.load_adapter(ad.name, ad, pinned=True)
    w = lora.weights[(0, "qkv_proj")]
    state = lambda: (dict(lora.pool.slot_of), set(lora.pool.pinned), set(lora.adapters),  # noqa: E731
                     lora.writer.writes, [t.clone() for t in (w.lora_a, w.ranks, w.scalings)])
    before = state()
    with pytest.raises(AdapterError, match="cannot pin 'c'.*pinned: \\['a', 'b'\\]"):
        lora.load_adapter("c", ads[2], pinned=True)
    after = state()
    assert before[:4] == after[:4]
    assert all(torch.equal(x, y) for x, y in zip(before[4], after[4], strict=True))
    lora.load_adapter("c", ads[2])  # unpinned, it loads (and waits for a slot)
    assert "c" in lora.adapters and "c" not in lora.pool.slot_of


@pytest.mark.gpu
def test_an_adapter_with_its_tensors_on_the_gpu_loads_and_computes_as_on_the_host():
    """The slot image is host memory, pinned on a GPU runtime: packing the tensors where they
    were left them on the GPU, and pinning one there raised 'cannot pin'."""
    runner = make_runtime(CFG, dtype=torch.float32, device="cuda", backend="triton", slots=2,
                          max_rank=8)
    host = random_adapter(CFG, "h", 4, seed=3, b_std=0.3)
    on_gpu = dataclasses.replace(host, name="g", modules={
        k: dataclasses.replace(m, a=m.a.cuda(), b=m.b.cuda()) for k, m in host.modules.items()})
    runner.lora.load_adapter("h", host)
    runner.lora.load_adapter("g", on_gpu)
    assert runner.lora.images["g"].data.device.type == "cpu"
    assert runner.lora.images["g"].data.is_pinned()
    prompt = [3, 1, 4, 1, 5]
    reqs = [Request(prompt, n) for n in ("h", "g")]
    logits = runner.forward_eager(build_extend(reqs, runner.kv, "cuda"))
    release(reqs, runner.kv)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    ref = reference_logits(merged_model(runner.model, host), prompt, torch.float32, "cuda")
    torch.testing.assert_close(logits[1], ref, rtol=1e-4, atol=1e-4)
