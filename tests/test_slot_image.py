"""Slot writes through packed slot images (``lora_runtime/lora/slot_image.py``): a written
slot holds exactly the adapter's weights at their ranks, zeros in the rest of the slot, and
its ranks and scalings per slice, whatever the slot held before (NaN-poisoned here), for
adapters with per-slice ranks, missing slices, embed_tokens and lm_head; two writes in a row
through the shared staging buffers keep their own contents; an unsharded adapter's tensors
are views of its image (host memory once) and keep their values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from runtime_helpers import ALL_TARGETS, make_runtime

from lora_runtime.lora.adapters import random_adapter
from lora_runtime.model.config import tiny
from lora_runtime.model.modules import SLICES

CFG = tiny()
MAX_RANK = 8


def _uneven(name: str, seed: int):
    """Targets with different ranks (rank_pattern-like: q at 3, the rest at 5); k_proj and
    up_proj missing."""
    full = random_adapter(CFG, name, 5, [t for t in ALL_TARGETS if t not in ("k_proj",
                                                                          "up_proj")],
                          seed=seed, b_std=0.3)
    mods = {k: (dataclasses.replace(m, a=m.a[:3].clone(), b=m.b[:, :3].clone())
                if k[1] == "q_proj" else m) for k, m in full.modules.items()}
    return dataclasses.replace(full, modules=mods)


def _expected(lora, adapter, key, w):
    """The slot contents the kernels expect, built slice by slice from the adapter."""
    layer, module = key
    a, b = torch.zeros_like(w.lora_a[0]), torch.zeros_like(w.lora_b[0])
    ranks = torch.zeros(w.num_slices, dtype=torch.int32)
    scal = torch.zeros(w.num_slices)
    for s, target in enumerate(SLICES[module]):
        m = adapter.modules.get((layer, target))
        if m is None:
            continue
        r, ranks[s], scal[s] = m.rank, m.rank, m.scaling
        if w.is_embedding:
            a[:, :r], b[:, :r] = m.a.t(), m.b
        else:
            lo, hi = w.slice_bounds[s], w.slice_bounds[s + 1]
            a[s * w.max_rank : s * w.max_rank + r] = m.a
            b[lo:hi, :r] = m.b
    return a, b, ranks, scal


def _check_slot(lora, slot, ad):
    for key, w in lora.weights.items():
        a, b, ranks, scal = _expected(lora, ad, key, w)
        assert torch.equal(w.lora_a[slot].cpu(), a.cpu()), (ad.name, key, "A")
        assert torch.equal(w.lora_b[slot].cpu(), b.cpu()), (ad.name, key, "B")
        assert torch.equal(w.ranks[slot].cpu(), ranks), (ad.name, key)
        assert torch.equal(w.scalings[slot].cpu(), scal), (ad.name, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_slots_hold_their_adapter_and_nothing_else(dtype):
    rt = make_runtime(CFG, dtype=dtype, device=DEVICE, slots=3, max_rank=MAX_RANK)
    lora = rt.lora
    for w in lora.weights.values():  # whatever a slot held before must not survive
        for t in (w.lora_a, w.lora_b, w.scalings):
            t.fill_(float("nan"))
        w.ranks.fill_(7)
    adapters = [_uneven("U", 1), random_adapter(CFG, "F", MAX_RANK, ALL_TARGETS, seed=2),
                random_adapter(CFG, "O", 2, ["o_proj", "embed_tokens"], seed=3)]
    originals = {ad.name: {k: (m.a.to(dtype).clone(), m.b.to(dtype).clone())
                           for k, m in ad.modules.items()} for ad in adapters}
    for ad in adapters:
        lora.load_adapter(ad.name, ad)
    writes = lora.writer.writes
    lora.pin_adapter("U")
    lora.pin_adapter("F")  # second write through the same staging buffers
    lora.pin_adapter("O")
    assert lora.writer.writes == writes + 3
    for name, slot in lora.pool.slot_of.items():
        ad = lora.adapters[name]
        for (k, m) in ad.modules.items():  # the served tensors kept their values
            a0, b0 = originals[name][k]
            assert torch.equal(m.a, a0) and torch.equal(m.b, b0)
        _check_slot(lora, slot, ad)
    # Rotate: each slot now takes another adapter (other ranks, other targets), through the
    # views the writer cached for the first round.
    names = list(lora.pool.slot_of)
    for name, slot in zip(names[1:] + names[:1], [lora.pool.slot_of[n] for n in names],
                          strict=True):
        lora.writer.write(lora.images[name], slot)
        _check_slot(lora, slot, lora.adapters[name])
    for w in lora.weights.values():  # the neutral row is never written
        assert (w.ranks[w.neutral_slot] == 7).all()


def test_unsharded_adapters_share_their_image():
    rt = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=MAX_RANK)
    lora = rt.lora
    lora.load_adapter("U", _uneven("U", 4))
    image, ad = lora.images["U"], lora.adapters["U"]
    lo = image.data.data_ptr()
    hi = lo + image.data.nbytes
    for m in ad.modules.values():
        for t in (m.a, m.b):
            assert lo <= t.data_ptr() < hi
    numel = sum(m.a.numel() + m.b.numel() for m in ad.modules.values())
    assert image.data.numel() == numel  # packed at the adapter's ranks: no padding
    lora.unload_adapter("U")
    assert "U" not in lora.images


def test_cleared_slot_has_rank_zero_everywhere():
    rt = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=MAX_RANK)
    lora = rt.lora
    lora.load_adapter("F", random_adapter(CFG, "F", 4, ALL_TARGETS, seed=5), pinned=True)
    slot = lora.pool.slot_of["F"]
    lora.pin_adapter("F", False)
    lora.unload_adapter("F")
    for w in lora.weights.values():
        assert (w.ranks[slot] == 0).all() and (w.scalings[slot] == 0).all()


def test_an_image_packed_for_larger_weights_is_refused():
    small = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=2)
    big = make_runtime(CFG, dtype=torch.float32, device=DEVICE, slots=2, max_rank=MAX_RANK)
    big.lora.load_adapter("F", random_adapter(CFG, "F", MAX_RANK, ALL_TARGETS, seed=6))
    with pytest.raises(ValueError, match="does not fit a slot"):
        small.lora.writer.write(big.lora.images["F"], 0)
