"""Targeted replay scenarios (the schedules find these too, but rarely): an adapter moved to
another slot between two replays of the same adapter mix, an idle replay between two
identical batches, batch sizes crossing buckets, a base-only batch."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from schedule_world import World

from lora_runtime.engine.requests import Request, build_decode, build_extend, release


@pytest.fixture(scope="module")
def world():
    return World("torch", DEVICE, torch.float32)


def _decode_ready(w: World, names, prompt_len=3):
    reqs = [Request(list(range(1, prompt_len + 1 + i)), n, 64) for i, n in enumerate(names)]
    logits = w.check_step(build_extend(reqs, w.runner.kv, DEVICE))
    for r, row in zip(reqs, logits, strict=True):
        r.output.append(int(row.argmax()))
    return reqs


def _decode(w: World, reqs):
    logits = w.check_step(build_decode(reqs, w.runner.kv, DEVICE))
    for r, row in zip(reqs, logits, strict=True):
        w.check_oracle(r.tokens, r.adapter, row)
        r.output.append(int(row.argmax()))


def test_same_adapter_mix_after_the_adapter_moved_slot(world):
    w = world
    w.reset()
    reqs = _decode_ready(w, ["ad0", "ad1", None])
    _decode(w, reqs)
    old_slot = w.lora.pool.slot_of["ad0"]
    adapter = w.lora.adapters["ad0"]
    w.lora.reset_lora_batch()
    w.lora.unload_adapter("ad0")
    w.new_adapter(seed=99, pinned=True)  # takes the freed slot
    w.lora.load_adapter("ad0", adapter)
    _decode(w, reqs)
    assert w.lora.pool.slot_of["ad0"] != old_slot, "the scenario needs ad0 in another slot"
    release(reqs, w.runner.kv)


def test_idle_replay_between_identical_batches(world):
    w = world
    w.reset()
    reqs = _decode_ready(w, ["ad1", "ad2"])
    _decode(w, reqs)
    w.check_idle()
    _decode(w, reqs)
    release(reqs, w.runner.kv)


def test_batch_sizes_crossing_buckets_and_base_only(world):
    w = world
    w.reset()
    pool = _decode_ready(w, ["ad0", None, "ad1", "ad2", None, "ad0", "ad1", None])
    for n in (1, 3, 8, 2, 5, 1):
        _decode(w, pool[:n])
        _decode(w, [r for r in pool[:n] if r.adapter is None] or pool[1:2])
    release(pool, w.runner.kv)


def test_replay_before_capture_is_refused_and_leaves_state():
    from runtime_helpers import drawn_adapter, make_runtime

    from graphs import GraphRunner
    from lora_runtime.model.config import tiny

    cfg = tiny(1)
    rt = make_runtime(cfg, dtype=torch.float32, device=DEVICE, backend="torch", slots=2,
                      max_rank=4)
    rt.lora.load_adapter("a", drawn_adapter(cfg, "a", 1, 4))
    graphs = GraphRunner.decode(rt, [1, 2], 16)
    r = Request([1, 2, 3], "a", 4)
    rt.forward_eager(build_extend([r], rt.kv, DEVICE))
    r.output.append(5)
    rt.lora.reset_lora_batch()
    batch = build_decode([r], rt.kv, DEVICE)
    assert not graphs.can_run(batch)
    slots_before = dict(rt.lora.pool.slot_of)
    with pytest.raises(RuntimeError, match="capture"):
        graphs.replay(batch)
    assert rt.lora.backend.batch_info is None
    assert rt.lora.pool.slot_of == slots_before


@pytest.mark.parametrize("make, says", [
    # An IndexError, a capture failing on "rows=-1", a torch size error, or accepted as is:
    (lambda rt, G: G.decode(rt, [], 16), "graph buckets must be a non-empty list"),
    (lambda rt, G: G.decode(rt, [-1, 2], 16), "graph buckets must be a non-empty list"),
    (lambda rt, G: G.decode(rt, [0, 2], 16), "graph buckets must be a non-empty list"),
    (lambda rt, G: G.decode(rt, [2.5], 16), "graph buckets must be a non-empty list"),
    (lambda rt, G: G.decode(rt, [2], -1), "max_context must be an integer >= 1"),
    (lambda rt, G: G.decode(rt, [2], 0), "max_context must be an integer >= 1"),
    (lambda rt, G: G.prefill(rt, [], 4), "graph buckets must be a non-empty list"),
    (lambda rt, G: G.prefill(rt, [8], 0), "max_requests must be an integer >= 1"),
    (lambda rt, G: G.prefill(rt, [8], 2, -1), "max_prefix must be an integer >= 0"),
])
def test_graph_sizes_that_cannot_serve_are_refused_naming_them(make, says):
    from runtime_helpers import make_runtime

    from graphs import GraphRunner
    from lora_runtime.model.config import tiny

    rt = make_runtime(tiny(1), dtype=torch.float32, device=DEVICE, slots=2, max_rank=4)
    with pytest.raises(ValueError, match=says):
        make(rt, GraphRunner)


@pytest.mark.parametrize("mode", ["prefix past max_prefix", "context past max_context"])
def test_an_agreed_bucket_never_takes_a_batch_no_bucket_holds(mode):
    """``replay(batch, bucket=...)`` (the DP agreement's bucket) of a batch that no bucket
    holds: a prefill whose cached prefix exceeds ``max_prefix`` replayed logits 0.18 off eager
    with no error (its context cut at the bucket's view); a decode wider than ``max_context``
    failed inside torch after LoRA was prepared. Refused, naming the batch, state unchanged."""
    from runtime_helpers import drawn_adapter, make_runtime

    from graphs import GraphRunner
    from lora_runtime.model.config import tiny

    cfg = tiny(1)
    rt = make_runtime(cfg, dtype=torch.float32, device=DEVICE, backend="torch", slots=2,
                      max_rank=4)
    rt.lora.load_adapter("a", drawn_adapter(cfg, "a", 1, 4))
    r = Request(list(range(1, 27)), "a", 8)
    rt.forward_eager(build_extend([r], rt.kv, DEVICE))  # 26 cached tokens
    r.output += [5, 6, 7, 8]
    if mode == "prefix past max_prefix":  # buckets' views hold 16 + 8 keys, the batch 30
        graphs = GraphRunner.prefill(rt, [16, 48], 2, max_prefix=8).capture()
        batch, bucket = build_extend([r], rt.kv, DEVICE), 16
    else:
        graphs = GraphRunner.decode(rt, [1, 2], max_context=16).capture()
        r.output = r.output[:1]
        batch, bucket = build_decode([r], rt.kv, DEVICE), 2
    assert graphs.bucket_for(batch) is None
    rt.lora.reset_lora_batch()
    version = rt.lora.pool.version
    with pytest.raises(ValueError, match="no captured bucket fits this .* batch of 1 requests"):
        graphs.replay(batch, bucket=bucket)
    assert rt.lora.backend.batch_info is None
    assert rt.lora.pool.version == version
    release([r], rt.kv)


@pytest.mark.parametrize("variant", ["base", "peers"])
def test_a_variant_that_drops_the_batchs_lora_is_refused(world, variant):
    w = world
    w.reset()
    reqs = _decode_ready(w, ["ad0", None])
    batch = build_decode(reqs, w.runner.kv, DEVICE)
    with pytest.raises(ValueError, match=f"variant '{variant}' would drop the LoRA .*'ad0'"):
        w.decode.replay(batch, variant=variant)
    logits = w.decode.replay(batch, variant="lora")  # the right variant still serves it
    for r, row in zip(reqs, logits, strict=True):
        w.check_oracle(r.tokens, r.adapter, row)
    release(reqs, w.runner.kv)
