"""LoRA's bytes floor: the adapter weights a step cannot avoid reading.

A step reads the A and B of every distinct adapter among its rows at least once (this rank's
shard under DP, at each adapter's own rank). At the copy rate measured in the same run that
is the least time LoRA can add to a step whose base part already runs at the bandwidth
limit; set beside LoRA's measured cost it says how much of that cost the hardware imposes.
(The floor assumes LoRA's reads cannot hide in the base step's slack: a base step below its
own bandwidth floor could in principle absorb some of them.)
"""

from __future__ import annotations

from collections.abc import Iterable


def adapter_bytes(lora, names: Iterable[str | None]) -> int:
    """Bytes of the distinct adapters among ``names`` (None: the base model; ``lora``: a
    ``LoRAManager``), as their slot images hold them, less an embedding adapter's A table
    (``[vocab, r]``): a step gathers only its tokens' rows of it (a few hundred bytes, not
    counted), where counting the table put the floor of an adapter on ``embed_tokens`` ~4 MB
    a step too high at Llama-3's vocabulary."""
    total = 0
    for n in set(names):
        if n is None:
            continue
        image, embed = lora.images[n], lora.adapters[n].modules.get((None, "embed_tokens"))
        table = 0 if embed is None else embed.a.numel() * image.data.element_size()
        total += image.data.nbytes - table
    return total


def floor_us(nbytes: int, copy_gbps: float) -> float:
    return nbytes / (copy_gbps * 1e3)


def pass_floor_ms(lora, steps, copy_gbps: float) -> float:
    """LoRA's bytes floor over a serving pass: each step's distinct adapters read once
    (``steps``: the engine's ``StepRecord`` timeline)."""
    return sum(floor_us(adapter_bytes(lora, s.adapters), copy_gbps) for s in steps) / 1e3
