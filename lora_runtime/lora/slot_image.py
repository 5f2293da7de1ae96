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
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernels import LoRAWeights
from lora_runtime.lora.adapters import LoRAAdapter, ModuleLoRA
from lora_runtime.model.modules import SLICES

WeightKey = tuple[int | None, str]


class _Block(NamedTuple):  # a tuple: hashed in C, it keys the writer's view caches
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
    staged: tuple | None = field(default=None, compare=False, repr=False)
    """(staging buffer, its views per block) once a writer staged this image."""

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
                    # The image lives on the host (slot writes copy it in; pinned on a GPU
                    # runtime): an adapter whose tensors are on the GPU is copied out.
                    parts.append(t.reshape(-1).to("cpu", dtype))
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
    """Moves slot images into the weights' slots through device staging buffers the size of
    one slot (every image fits). The views a write touches are built once and kept: a write
    is host-bound on a slow host otherwise (~1,000 tensor views for 32 layers)."""

    def __init__(self, weights: dict[WeightKey, LoRAWeights], device: torch.device) -> None:
        self.weights, self.device = weights, device
        self._staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._table_sources: tuple[list, list] = ([], [])
        self._slot_views: dict[int, tuple[list, list, list]] = {}
        self._regions: dict[tuple[int, _Block], torch.Tensor] = {}
        self.writes = 0
        """Slot writes so far (adapters moved into a slot)."""

    def write(self, image: SlotImage, slot: int) -> None:
        self._stage(image)
        zero, rank_dst, scal_dst = self._views_of(slot)
        torch._foreach_zero_(zero)
        if image.blocks:
            regions = self._regions
            dst = [regions.get((slot, b)) for b in image.blocks]
            for i, v in enumerate(dst):
                if v is None:
                    dst[i] = regions[(slot, image.blocks[i])] = self._region(image.blocks[i],
                                                                             slot)
            torch._foreach_copy_(dst, image.staged[1])
        torch._foreach_copy_(rank_dst, self._table_sources[0])
        torch._foreach_copy_(scal_dst, self._table_sources[1])
        self.writes += 1

    def clear(self, slot: int) -> None:
        """Rank 0 everywhere: every kernel skips the slot (its weights stay as they were)."""
        _, rank_dst, scal_dst = self._views_of(slot)
        torch._foreach_zero_(rank_dst + scal_dst)

    def _views_of(self, slot: int) -> tuple[list, list, list]:
        """(the slot's A and B blocks, its ranks rows, its scalings rows)."""
        views = self._slot_views.get(slot)
        if views is None:
            ws = list(self.weights.values())
            views = self._slot_views[slot] = (
                [w.lora_a[slot] for w in ws] + [w.lora_b[slot] for w in ws],
                [w.ranks[slot] for w in ws], [w.scalings[slot] for w in ws])
        return views

    def _region(self, b: _Block, slot: int) -> torch.Tensor:
        w = self.weights[b.key]
        if w.is_embedding:
            return (w.lora_a if b.part == "a" else w.lora_b)[slot, :, : b.cols]
        if b.part == "a":
            return w.lora_a[slot, b.slice * w.max_rank : b.slice * w.max_rank + b.rows]
        lo, hi = w.slice_bounds[b.slice], w.slice_bounds[b.slice + 1]
        return w.lora_b[slot, lo:hi, : b.cols]

    def _stage(self, image: SlotImage) -> None:
        """Copies the image into the staging buffers (non-blocking: pinned on CUDA)."""
        if self._staging is None:
            ws = list(self.weights.values())
            slot_numel = sum(w.lora_a[0].numel() + w.lora_b[0].numel() for w in ws)
            widths = [w.num_slices for w in ws]
            self._staging = (
                torch.empty(slot_numel, dtype=image.data.dtype, device=self.device),
                torch.empty(sum(widths), dtype=torch.int32, device=self.device),
                torch.empty(sum(widths), dtype=torch.float32, device=self.device))
            self._table_sources = (list(self._staging[1].split(widths)),
                                   list(self._staging[2].split(widths)))
        buf, ranks, scalings = self._staging
        if image.data.numel() > buf.numel():
            raise ValueError(f"a slot image of {image.data.numel()} elements does not fit a "
                             f"slot of {buf.numel()}: it was packed for other weights")
        data = buf[: image.data.numel()]
        if image.staged is None or image.staged[0] is not buf:
            image.staged = (buf, _blocks_of(data, image.blocks))
        data.copy_(image.data, non_blocking=True)
        ranks.copy_(image.ranks, non_blocking=True)
        scalings.copy_(image.scalings, non_blocking=True)


def _blocks_of(flat: torch.Tensor, blocks: tuple[_Block, ...]) -> list[torch.Tensor]:
    """``flat`` (an image's data, or its staged copy) cut into its blocks' [rows, cols]."""
    return [t.view(b.rows, b.cols) for t, b in
            zip(flat.split([b.rows * b.cols for b in blocks]), blocks, strict=True)]
