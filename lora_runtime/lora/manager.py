"""``LoRAManager``: wraps the model's target modules, keeps adapters in host memory, moves
them into GPU slots on demand, and prepares or resets the backend's batch state."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from torch import nn

from kernels import LoRAWeights, SegmentSpec
from kernels.checks import FLOAT_DTYPES
from kernels.config import interpreted
from lora_runtime.engine.forward_batch import ForwardBatch, ForwardMode, GatheredRows
from lora_runtime.lora.adapters import AdapterError, LoRAAdapter, load_peft_adapter
from lora_runtime.lora.backends import LoRAGraphBuffers, make_backend
from lora_runtime.lora.batch_info import (
    DECODE_BLOCK_M,
    EXTEND_BLOCK_M,
    LOGITS_BLOCK_M,
    LoRABatchPlan,
)
from lora_runtime.lora.layers import WRAPPERS, LoRALayer
from lora_runtime.lora.lora_config import LoRAConfig
from lora_runtime.lora.slot_image import SlotImage, SlotWriter
from lora_runtime.lora.slot_pool import SlotPool, SlotPoolError
from lora_runtime.model.llama import LlamaForCausalLM
from lora_runtime.model.modules import BLOCK_OF, LAYER_MODULES, TENSOR_PARALLEL, module_path
from lora_runtime.nvtx import phase


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: LoRAConfig) -> None:
        wrapped = next((name for name, m in model.named_modules() if isinstance(m, LoRALayer)),
                       None)
        if wrapped is not None:
            # Wrapping again nests wrappers: an embedding or lm_head adapter then fails to load.
            raise ValueError(f"model: {wrapped} already has LoRA layers (a LoRAManager was built "
                             "on this model); use that manager, or build one on a fresh model")
        self.model, self.config = model, config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        _check_backend_dtype(config.backend, self.dtype)
        self.backend = make_backend(config.backend, config.max_loras_per_batch, self.device)
        self.neutral_slot = self.backend.neutral_slot
        self.weights: dict[tuple[int | None, str], LoRAWeights] = {}
        self.pool = SlotPool(config.max_loras_per_batch)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.images: dict[str, SlotImage] = {}
        """Each loaded adapter packed for slot writes (``slot_image.py``)."""
        self.fingerprints: dict[str, int] = {}
        """Each loaded adapter's ``LoRAAdapter.fingerprint`` where the MLP is sharded for DP
        (the ranks compare them each step; 0 without DP: nothing to compare with)."""
        self._in_batch: set[str] = set()
        self.evict_last: Callable[[], Collection[str]] = frozenset
        """Adapters that eviction takes only where no other is left: the running requests',
        a function the engine sets before each forward and pin, called only when a slot must
        be freed (no per-step cost). A step that leaves running requests out (a prefill)
        then evicts an idle adapter, not one the next decode step would have to write back
        (a slot write: 1.7 ms at 32 layers). Under DP every rank's returns the same (the
        agreed union), so slots agree."""
        self.requested: Callable[[], Collection[str]] = frozenset
        """Adapters that waiting or running requests of the engine serving through this
        manager use (the engine sets it): the manager's own unload refuses them, as its pins
        leave room for ``evict_last``'s (called from outside the engine, they had taken a
        decoding request's slot or adapter, and every later step raised)."""
        self._last_plan: tuple | None = None
        """(batch key, pool version, adapters, plan) of the last batch planned locally."""
        self.dp = model.dp
        """Set when the model's MLP is sharded for DP attention (its LoRA is sharded to match)."""
        self._wrap_modules()
        self.writer = SlotWriter(self.weights, self.device)

    # -- batch state (contracts 1 and 3) ------------------------------------------------------
    def prepare_lora_batch(self, batch: ForwardBatch) -> None:
        """Sets the backend's batch state for this forward. A batch without adapters (or an
        idle one) resets it instead, so its forward runs no LoRA launch at all. Under DP
        that holds for the whole step: an idle rank, or one without adapters, still prepares
        the MLP's gathered layout when another rank's rows have adapters."""
        active = batch.has_adapters if batch.gathered is None else batch.gathered.has_adapters
        if not active or (batch.mode is ForwardMode.IDLE and batch.gathered is None):
            self.reset_lora_batch()
            return
        self.backend.prepare(self.plan_lora_batch(batch))

    def reset_lora_batch(self) -> None:
        self.backend.reset_batch_state()
        self._in_batch = set()

    def plan_lora_batch(self, batch: ForwardBatch) -> LoRABatchPlan:
        """Moves the batch's adapters into slots (evicting LRU ones) and plans its layouts.
        Raises, changing nothing, when an adapter is unknown or they cannot all fit."""
        names = batch.adapter_names
        g = batch.gathered
        key = None if g is not None else (batch.mode, names, batch.extend_lens)
        last = self._last_plan
        if key is not None and last is not None and last[:2] == (key, self.pool.version):
            # The previous batch again (decode steps of unchanged requests): its adapters hold
            # the same slots, so its plan is this one's. The LRU clock still moves.
            self.pool.touch(last[2])
            self._in_batch = last[2]
            return last[3]
        used = set(names if g is None else [n for rank in g.adapters for n in rank])
        used.discard(None)
        unknown = used - self.adapters.keys()
        if unknown:
            raise KeyError(f"the batch names adapters that are not loaded: {sorted(unknown)}. "
                           "Call LoRAManager.load_adapter(name, path) first")
        if g is not None:
            _check_gathered_rows(g)  # before any slot moves: the prepared batch keeps its own
        # Under DP every rank acquires the same union in the same order; slots may still
        # differ between ranks (a pin undone on one): gathered rows map names to this rank's.
        self._acquire(used)
        slot_of = {None: self.neutral_slot, **self.pool.slot_of}
        slots = [slot_of[n] for n in names]
        skip = self.neutral_slot
        if batch.mode is ForwardMode.IDLE:  # under DP: no local rows, in the step's layout
            step_mode = ForwardMode.DECODE if g is None else g.mode
            rows = SegmentSpec((), None, DECODE_BLOCK_M if step_mode is ForwardMode.DECODE
                               else EXTEND_BLOCK_M, None)
            logits = SegmentSpec((), None, LOGITS_BLOCK_M, None)
        elif batch.mode is ForwardMode.DECODE:
            rows = SegmentSpec(tuple(slots), None, DECODE_BLOCK_M, skip)
            logits = SegmentSpec(tuple(slots), None, LOGITS_BLOCK_M, skip)
        else:
            rows = SegmentSpec(tuple(slots), tuple(batch.extend_lens), EXTEND_BLOCK_M, skip)
            logits = SegmentSpec(tuple(slots), None, LOGITS_BLOCK_M, skip)
        plan = LoRABatchPlan(rows, logits, None if g is None else self._gathered_spec(g))
        self._in_batch = used
        self._last_plan = None if key is None else (key, self.pool.version, used, plan)
        return plan

    def _gathered_spec(self, g: GatheredRows) -> SegmentSpec:
        """Every rank's rows, rank after rank, each rank's padded (neutral) to rows_per_rank
        (``_check_gathered_rows`` passed)."""
        slots, lens = [], []
        for names, rank_lens in zip(g.adapters, g.lens, strict=True):
            pad = g.rows_per_rank - sum(rank_lens)
            slots += [self.neutral_slot if n is None else self.pool.slot_of[n] for n in names]
            lens += [*rank_lens, pad]
            slots.append(self.neutral_slot)
        block_m = DECODE_BLOCK_M if g.mode is ForwardMode.DECODE else EXTEND_BLOCK_M
        return SegmentSpec(tuple(slots), tuple(lens), block_m, self.neutral_slot)

    # -- graph hooks: a graph runner's only contact with LoRA ------------------------------
    def init_graph_buffers(self, mode: ForwardMode, max_rows: int,
                           max_requests: int) -> LoRAGraphBuffers:
        """Static LoRA metadata for one graph runner (allocated once; the runner owns it)."""
        block_m = DECODE_BLOCK_M if mode is ForwardMode.DECODE else EXTEND_BLOCK_M
        dp_size = 1 if self.dp is None else self.dp.size
        return self.backend.init_capture_buffers(max_rows, max_requests, block_m, dp_size)

    def prepare_for_capture(self, buffers: LoRAGraphBuffers, rows: int, requests: int,
                            local: bool = True) -> None:
        """Points the batch state at ``buffers``, neutral, for capturing a LoRA variant
        (``local=False``: the peers variant, LoRA on the MLP's gathered rows only)."""
        self.reset_lora_batch()
        self.backend.prepare_for_capture(buffers, rows, requests, local)

    def prepare_for_replay(self, buffers: LoRAGraphBuffers, batch: ForwardBatch | None,
                           rows: int, requests: int, local: bool = True) -> None:
        """Before replaying a LoRA variant: plans ``batch`` (None: idle, all neutral; under
        DP an idle batch with its gathered rows), then refreshes ``buffers`` in place. A
        planning error raises before any buffer is written."""
        with phase("plan"):
            plan = None if batch is None else self.plan_lora_batch(batch)
        with phase("buffer refresh"):
            self.backend.prepare_for_replay(buffers, plan, rows, requests, local)

    # -- adapters ---------------------------------------------------------------------------
    def load_adapter(self, name: str, source: str | Path | LoRAAdapter, *,
                     pinned: bool = False) -> None:
        """Validates ``source`` (a PEFT folder or an adapter) and registers it as ``name``, the
        name its errors and the stored adapter carry (a LoRAAdapter's own ``name`` is not read,
        nor changed). With ``pinned`` it also takes a slot now and is never evicted. On any
        error the loaded adapters are unchanged; a slot write that failed leaves that slot
        empty (the adapter evicted for it is written again when a batch next uses it)."""
        if not isinstance(name, str):
            # None names the base model in a request: an adapter under it took the neutral
            # slot's place in every batch with adapters.
            raise AdapterError(f"an adapter name must be a string, got {name!r}; name it as "
                               "requests will (adapter=None serves the base model)")
        if not name.strip():  # read as "no adapter" by any truthiness test of a request's
            raise AdapterError(f"an adapter name must not be empty, got {name!r}; name it as "
                               "requests will (adapter=None serves the base model)")
        if name in self.adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        if not isinstance(pinned, bool):  # "no" or "false" pinned it by truthiness
            raise AdapterError(f"adapter {name!r}: pinned must be True or False, got "
                               f"{pinned!r}")
        if not isinstance(source, str | os.PathLike | LoRAAdapter):
            raise AdapterError(f"adapter {name!r}: source must be a PEFT adapter folder (a str "
                               f"or Path) or a LoRAAdapter, got {type(source).__name__} (a PEFT "
                               "model or state dict: save it with save_pretrained, pass the "
                               "folder)")
        # Named as loaded, as requests name it (its own name, another one's, was in its
        # errors); a copy, the caller's adapter left as it was.
        adapter = (dataclasses.replace(source, name=name) if isinstance(source, LoRAAdapter)
                   else load_peft_adapter(source, name))
        adapter.validate(self.model.config, self.config.max_rank, self.config.target_modules)
        self._check_base_layers(adapter)
        adapter = adapter.to(self.dtype)
        _check_representable(adapter, self.dtype)
        fingerprint = adapter.fingerprint() if self.dp is not None else 0
        image = SlotImage.pack(adapter, self.weights, self._local_weights, self.dtype,
                               pin=self.device.type == "cuda")
        if self.dp is None:  # unsharded: the adapter's tensors become views of its image
            adapter = image.share_with(adapter, self.weights)
        if pinned:
            try:
                self._check_room_to_pin(name)
                [(slot, _, _)] = self.pool.plan([name], self._in_batch, self.evict_last)
            except SlotPoolError as e:
                raise AdapterError(f"cannot pin {name!r}: {e}") from e
        self.adapters[name], self.images[name] = adapter, image
        self.fingerprints[name] = fingerprint
        if pinned:
            try:
                self._write_slot(slot, name)
            except BaseException:
                del self.adapters[name], self.images[name], self.fingerprints[name]
                raise
            self.pool.pinned.add(name)

    @torch.no_grad()
    def _check_base_layers(self, adapter: LoRAAdapter) -> None:
        own = {"embed_tokens": self.model.model.embed_tokens, "lm_head": self.model.lm_head}
        for target, t in adapter.base_layers.items():
            layer = own[target]
            w = getattr(layer, "base", layer).weight
            if not w.is_floating_point():  # torch.finfo below raised a bare TypeError
                raise AdapterError(
                    f"adapter {adapter.name!r} carries its own {target} weights, but the "
                    f"model's {target} weight has dtype {w.dtype} (a quantized layer), which "
                    "they cannot be compared with: serve the model in a floating dtype, or "
                    "save the adapter without them (PEFT: save_pretrained(..., "
                    "save_embedding_layers=False))")
            # Equal up to one rounding to the coarser dtype (a bf16 copy of float32 weights):
            # PEFT would serve the adapter's own weights where they differ by more. Below a
            # dtype's normal range its rounding is absolute (fp16: multiples of 2**-24, where
            # bf16 still has 8 bits): a bf16 checkpoint served in fp16 moves tiny weights by
            # more than a bf16 rounding of themselves.
            lo = max((t.dtype, w.dtype), key=lambda d: torch.finfo(d).eps)
            floor = max(torch.finfo(d).smallest_normal * torch.finfo(d).eps
                        for d in (t.dtype, w.dtype))
            a, b = t.to(w.device, lo).float(), w.to(lo).float()
            if not torch.allclose(a, b, rtol=torch.finfo(lo).eps, atol=floor):
                raise AdapterError(
                    f"adapter {adapter.name!r} carries its own {target} weights that differ "
                    "from the model's (a resized or trained vocabulary); this runtime serves "
                    "LoRA deltas on one shared base model only"
                )

    def unload_adapter(self, name: str) -> None:
        _check_name_type(name, "unload_adapter")
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(self.adapters)})")
        if name in self._in_batch:
            raise RuntimeError(f"adapter {name!r} is used by the prepared batch; finish or reset "
                               "the batch (reset_lora_batch) before unloading it")
        if name in self.requested():
            raise RuntimeError(f"adapter {name!r} is used by requests the engine serves "
                               "(waiting or running; the engine last built or stepped on this "
                               "manager); unload it once they finish (Engine.unload_adapter "
                               "names them), or abort them")
        slot = self.pool.release(name)
        if slot is not None:
            self._clear_slot(slot)
        del self.adapters[name], self.images[name], self.fingerprints[name]

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        if not isinstance(pinned, bool):  # "no" or 0.0 would pin or unpin by truthiness
            raise ValueError(f"pin_adapter({name!r}, pinned={pinned!r}): pinned must be True "
                             "or False")
        _check_name_type(name, "pin_adapter")
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(self.adapters)}); "
                           "load it with load_adapter first")
        if pinned:
            self._check_room_to_pin(name)
            self._acquire({name}, protected=self._in_batch)
            self.pool.pinned.add(name)
        else:
            self.pool.pinned.discard(name)

    def _check_room_to_pin(self, name: str) -> None:
        """A pin leaves a slot for each adapter the running requests use (``evict_last``):
        the pool would evict one of them last, but evict it, and the next step could not
        run (the engine checks the same before its pins)."""
        running = set(self.evict_last())
        need = running | self.pool.pinned | self._in_batch | {name}
        slots = self.config.max_loras_per_batch
        if len(need) > slots:
            raise SlotPoolError(f"pinning {name!r} would leave {len(need)} adapters for {slots} "
                                f"slots (running requests': {sorted(running)}, pinned: "
                                f"{sorted(self.pool.pinned)}, in the prepared batch: "
                                f"{sorted(self._in_batch)}). Unpin one or wait for requests "
                                "to finish")

    # -- slots ------------------------------------------------------------------------------
    def _acquire(self, names: set[str], protected: set[str] = frozenset()) -> None:
        for slot, name, _evicted in self.pool.plan(names, protected, self.evict_last):
            self._write_slot(slot, name)
        self.pool.touch(names)

    @torch.no_grad()
    def _write_slot(self, slot: int, name: str) -> None:
        # Hazard: the write zeroes the slot before copying in; one that fails part-way must
        # not leave the table naming the old owner over a half-written slot (a later batch
        # would serve it silently): the slot has no owner until the write has completed.
        old = self.pool.owner[slot]
        if old is not None:
            self.pool.release(old)
        self.writer.write(self.images[name], slot)
        self.pool.assign(slot, name)

    @torch.no_grad()
    def _clear_slot(self, slot: int) -> None:
        self.writer.clear(slot)

    # -- model surgery ----------------------------------------------------------------------
    def _wrap_modules(self) -> None:
        # Every slot buffer is allocated before the first wrap: an allocation that fails (out
        # of memory) leaves the model unwrapped, for a manager with a smaller pool.
        for parent, attr, key, weights in self._slot_buffers():
            self._wrap(parent, attr, key, weights)

    def _slot_buffers(self) -> list[tuple[nn.Module, str, tuple, LoRAWeights]]:
        """(parent, attribute, weights key, LoRAWeights) of every module to wrap."""
        cfg, n, r = self.model.config, self.config.max_loras_per_batch, self.config.max_rank
        wanted = self.config.runtime_modules
        out = []
        for layer_idx, layer in enumerate(self.model.model.layers):
            for module in LAYER_MODULES:
                if module in wanted:
                    k, widths = self._local_shape(module)
                    w = LoRAWeights.for_linear(n, k, widths, r, self.dtype, self.device)
                    out.append((getattr(layer, BLOCK_OF[module]), module, (layer_idx, module), w))
        if "embed_tokens" in wanted:
            w = LoRAWeights.for_embedding(n, cfg.vocab_size, cfg.hidden_size, r, self.dtype,
                                          self.device)
            out.append((self.model.model, "embed_tokens", (None, "embed_tokens"), w))
        if "lm_head" in wanted:
            w = LoRAWeights.for_linear(n, cfg.hidden_size, (cfg.vocab_size,), r, self.dtype,
                                       self.device)
            out.append((self.model, "lm_head", (None, "lm_head"), w))
        return out

    def _local_shape(self, module: str) -> tuple[int, tuple[int, ...]]:
        """(in_features, slice widths) this rank holds: under DP, A of a row-parallel module
        keeps its input shard and B of a column-parallel one its output shard."""
        shape = self.model.config.module_shape(module)
        k, widths = shape.in_features, shape.slice_widths
        kind = TENSOR_PARALLEL.get(module) if self.dp is not None else None
        if kind == "row":
            k //= self.dp.size
        elif kind == "column":
            widths = tuple(w // self.dp.size for w in widths)
        return k, widths

    def _local_weights(self, module: str, m):
        """This rank's shard of one adapter module's (A, B)."""
        kind = TENSOR_PARALLEL.get(module) if self.dp is not None else None
        if kind == "row":
            k = m.a.shape[1] // self.dp.size
            return m.a[:, self.dp.rank * k : (self.dp.rank + 1) * k], m.b
        if kind == "column":
            n = m.b.shape[0] // self.dp.size
            return m.a, m.b[self.dp.rank * n : (self.dp.rank + 1) * n]
        return m.a, m.b

    def _wrap(self, parent: nn.Module, attr: str, key, weights: LoRAWeights) -> None:
        base = getattr(parent, attr)
        setattr(parent, attr, WRAPPERS[attr](base, self.backend, weights))
        self.weights[key] = weights


def _check_backend_dtype(backend: str, dtype: torch.dtype) -> None:
    """The Triton kernels' dtypes, checked before wrapping: a model in another (a float64
    reference) was wrapped and failed its first LoRA forward inside a launch ("y has dtype
    torch.float64; expected fp16, bf16 or fp32")."""
    if backend == "triton" and dtype not in FLOAT_DTYPES:
        raise ValueError(f"LoRAConfig(backend='triton') cannot serve a {dtype} model (its "
                         "kernels take fp16, bf16 or fp32): use LoRAConfig(backend='torch'), "
                         "or load the model in one of those dtypes")
    if backend == "triton" and dtype == torch.bfloat16 and interpreted():
        # The kernels refuse it at their first launch: mid-step, after the set-up.
        raise ValueError("LoRAConfig(backend='triton') cannot serve a bf16 model under the "
                         "Triton interpreter (TRITON_INTERPRET=1: its bf16 tl.dot is wrong): "
                         "use LoRAConfig(backend='torch'), or load the model in fp16 or fp32")


def _check_name_type(name, what: str) -> None:
    # A list or dict name raised "unhashable type" from the membership test.
    if not isinstance(name, str):
        raise KeyError(f"{what}: an adapter name is a string, got {type(name).__name__} "
                       f"{name!r}; pass one adapter's name")


def _check_gathered_rows(g: GatheredRows) -> None:
    """Raises where a rank's rows exceed the step's agreed ``rows_per_rank``."""
    for rank, rank_lens in enumerate(g.lens):
        if sum(rank_lens) > g.rows_per_rank:
            raise ValueError(f"rank {rank} has {sum(rank_lens)} rows but the step agreed on "
                             f"{g.rows_per_rank} rows per rank")


def _check_representable(adapter: LoRAAdapter, dtype: torch.dtype) -> None:
    """``adapter`` cast to the model's ``dtype``: its weights, finite in their own dtype
    (``validate``), may not be in the model's (fp16 stops at 65504), nor its scalings in the
    float32 the kernels read them in."""
    for (layer, target), m in adapter.modules.items():
        where = f"adapter {adapter.name!r}, {module_path(layer, target)}"
        for label, t in (("lora_A", m.a), ("lora_B", m.b)):
            if not torch.isfinite(t).all():
                raise AdapterError(
                    f"{where}: {label} holds values beyond {dtype}'s range (|x| <= "
                    f"{torch.finfo(dtype).max:g}); rescale its weights (fold the factor into "
                    "lora_alpha) or serve it on a model of a wider dtype")
        if abs(m.scaling) > torch.finfo(torch.float32).max:
            raise AdapterError(f"{where}: scaling {m.scaling:g} does not fit float32, in which "
                               "the kernels read it; rescale lora_alpha or the weights")
