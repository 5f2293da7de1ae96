"""An adapter's slot image: what moving it into a pool slot copies, packed once at load time.

Packing puts every (layer, module) A and B of the adapter (this rank's shard under DP, at the
adapter's own ranks, no padding) into one flat host buffer, pinned where the device is CUDA,
and every weight's ranks and scalings row into two small ones. Writing a slot is then three
host-to-device copies into device staging buffers and three multi-tensor launches (zero the
slot's blocks, scatter A/B, set ranks/scalings), all stream-ordered and none synchronising,
instead of six small synchronous copies per slice (about 170 per slot for 4 layers).

Hazard: the staging buffers are shared by every write. Writes and the forwards that read the
slots run in one stream order, so a write's scatter finishes before the next write's copy
overwrites the staging; anything that writes slots on another stream must not use them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import LoRAWeights
from lora_runtime.lora.adapters import LoRAAdapter, ModuleLoRA
from lora_runtime.model.modules import SLICES

WeightKey = tuple[int | None, str]


@dataclass(frozen=True)
class _Block:
    key: WeightKey
    part: str
    """``a`` or ``b``."""
    slice: int
    rows: int
    cols: int


@dataclass
class SlotImage:
    data: torch.Tensor
    """Flat, model dtype: every block of ``blocks`` in order, each row-major."""
    blocks: tuple[_Block, ...]
    ranks: torch.Tensor
    """int32, every weight's ranks row (in ``weights`` order) one after another."""
    scalings: torch.Tensor
    """float32, laid out as ``ranks``."""

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.ranks.nbytes + self.scalings.nbytes

    @staticmethod
    def pack(adapter: LoRAAdapter, weights: dict[WeightKey, LoRAWeights], local_weights,
             dtype: torch.dtype, pin: bool) -> SlotImage:
        """``local_weights(module, ModuleLoRA) -> (a, b)``: this rank's shard of a module."""
        parts, blocks, ranks, scalings = [], [], [], []
        for key, w in weights.items():
            layer, module = key
            for s, target in enumerate(SLICES[module]):
                m = adapter.modules.get((layer, target))
                ranks.append(0 if m is None else m.rank)
                scalings.append(0.0 if m is None else m.scaling)
                if m is None:
                    continue
                # The slot layout: linear A rows [s*R, s*R+r) of [S*R, in], B columns [0, r)
                # of the slice's rows; embedding A is [vocab, R] (PEFT stores it [r, vocab]).
                a, b = (m.a.t(), m.b) if w.is_embedding else local_weights(module, m)
                for part, t in (("a", a), ("b", b)):
                    blocks.append(_Block(key, part, s, *t.shape))
                    parts.append(t.reshape(-1).to(dtype))
        data = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        image = SlotImage(data, tuple(blocks), torch.tensor(ranks, dtype=torch.int32),
                          torch.tensor(scalings, dtype=torch.float32))
        if pin:
            image.data, image.ranks, image.scalings = (
                t.pin_memory() for t in (image.data, image.ranks, image.scalings))
        return image

    def share_with(self, adapter: LoRAAdapter, weights: dict[WeightKey, LoRAWeights]
                   ) -> LoRAAdapter:
        """``adapter`` with its module tensors turned into views of this image (an image
        packed without sharding), so host memory holds its weights once."""
        views: dict[tuple, torch.Tensor] = {}
        for b, v in zip(self.blocks, _blocks_of(self.data, self.blocks), strict=True):
            layer, module = b.key
            emb_a = weights[b.key].is_embedding and b.part == "a"
            views[(layer, SLICES[module][b.slice], b.part)] = v.t() if emb_a else v
        mods = {k: ModuleLoRA(views[(*k, "a")], views[(*k, "b")], m.scaling)
                for k, m in adapter.modules.items()}
        return dataclasses.replace(adapter, modules=mods)


class SlotWriter:
    """Moves slot images into the weights' slots through device staging buffers that grow to
    the largest image written."""

    def __init__(self, weights: dict[WeightKey, LoRAWeights], device: torch.device) -> None:
        self.weights, self.device = weights, device
        self._staging: dict[str, torch.Tensor] = {}
        self.writes = 0
        """Slot writes so far (adapters moved into a slot)."""

    def write(self, image: SlotImage, slot: int) -> None:
        data, ranks, scalings = (self._stage(name, getattr(image, name))
                                 for name in ("data", "ranks", "scalings"))
        ws = list(self.weights.values())
        torch._foreach_zero_([w.lora_a[slot] for w in ws] + [w.lora_b[slot] for w in ws])
        if image.blocks:
            torch._foreach_copy_([self._region(b, slot) for b in image.blocks],
                                 _blocks_of(data, image.blocks))
        widths = [w.num_slices for w in ws]
        torch._foreach_copy_([w.ranks[slot] for w in ws], list(ranks.split(widths)))
        torch._foreach_copy_([w.scalings[slot] for w in ws], list(scalings.split(widths)))
        self.writes += 1

    def clear(self, slot: int) -> None:
        """Rank 0 everywhere: every kernel skips the slot (its weights stay as they were)."""
        ws = list(self.weights.values())
        torch._foreach_zero_([w.ranks[slot] for w in ws] + [w.scalings[slot] for w in ws])

    def _region(self, b: _Block, slot: int) -> torch.Tensor:
        w = self.weights[b.key]
        if w.is_embedding:
            return (w.lora_a if b.part == "a" else w.lora_b)[slot, :, : b.cols]
        if b.part == "a":
            return w.lora_a[slot, b.slice * w.max_rank : b.slice * w.max_rank + b.rows]
        lo, hi = w.slice_bounds[b.slice], w.slice_bounds[b.slice + 1]
        return w.lora_b[slot, lo:hi, : b.cols]

    def _stage(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """``host``'s copy on the device (non-blocking: the image is pinned on CUDA)."""
        buf = self._staging.get(name)
        if buf is None or buf.numel() < host.numel():
            buf = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
            self._staging[name] = buf
        out = buf[: host.numel()]
        out.copy_(host, non_blocking=True)
        return out


def _blocks_of(flat: torch.Tensor, blocks: tuple[_Block, ...]) -> list[torch.Tensor]:
    """``flat`` (an image's data, or its staged copy) cut into its blocks' [rows, cols]."""
    return [t.view(b.rows, b.cols) for t, b in
            zip(flat.split([b.rows * b.cols for b in blocks]), blocks, strict=True)]
