"""An independent reference for a LoRA runtime's logits: a request run alone, from scratch,
through a plain copy of the model (no LoRA wrappers) whose weights are ``W + s * B @ A`` of
the request's adapter, taken from the host adapter the bench built. None of the runtime's
slots, slot images (ranks, scalings), layouts, LoRA backends or kernels is on this path, so
a fault there that graph and eager share (a scaling off, a module or a fused slice dropped,
rows given another slot's adapter) shows up here, where "graph replay == eager" cannot see
it.

Judged by the error of the LoRA term on the logits: ``|got - ref| / |ref - base|`` (base:
the same request through the unmerged copy), so a fault in a term that moves the logits by
a few percent is not lost in the logits' size."""

from __future__ import annotations

import copy

import torch

from lora_runtime.engine.kv_cache import KVCache
from lora_runtime.engine.model_runner import ModelRunner
from lora_runtime.engine.requests import Request, build_extend
from lora_runtime.lora.adapters import LoRAAdapter
from lora_runtime.model.llama import LlamaForCausalLM
from lora_runtime.model.modules import BY_NAME

TOL = {torch.float32: 1e-3}
"""The LoRA term's relative error allowed per dtype. fp32 (CPU profile): a correct runtime
measured 3e-7..8e-7 (the term is 40-90% of the logits' norm there); a 2% scaling error
measures 2e-2. Other dtypes are measured and recorded, not judged: what a correct bf16
runtime measures against its merged weights has not been measured on a GPU."""
REQUESTS = 4
"""Requests checked per batch: the first of each distinct adapter up to this many, and the
last request of the batch."""


class MergedReference:
    def __init__(self, model: LlamaForCausalLM, adapters: dict[str, LoRAAdapter]) -> None:
        self.plain = _unwrapped(model)
        self.adapters = adapters
        self.dtype = next(self.plain.parameters()).dtype
        self.device = next(self.plain.parameters()).device

    def picked(self, names) -> list[int]:
        """Indices of the requests to check (``names``: each request's adapter)."""
        first: dict = {}
        for i, n in enumerate(names):
            first.setdefault(n, i)
        rows = sorted(first.values())[:REQUESTS]
        return sorted({*rows, len(names) - 1}) if names else []

    @torch.no_grad()
    def logits(self, tokens: list[int], adapter: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(merged, base) last-position logits of ``tokens`` run alone."""
        base = self._run(tokens)
        if adapter is None:
            return base, base
        saved = self._merge(self.adapters[adapter])
        try:
            return self._run(tokens), base
        finally:
            for w, orig in saved:
                w.copy_(orig)

    def check(self, got: torch.Tensor, reqs, dtype: torch.dtype, what: str) -> dict:
        """``got``: the runtime's logits of ``reqs`` (row i: request i). Raises
        ``AssertionError`` where a checked request's LoRA term is off by more than ``TOL``."""
        worst, effect = 0.0, 0.0
        for i in self.picked([r.adapter for r in reqs]):
            r = reqs[i]
            ref, base = self.logits(list(r.prompt) + list(r.output), r.adapter)
            term = (ref.double() - base.double()).norm().item()
            err = (got[i].double() - ref.double()).norm().item() / max(term, 1e-30)
            if r.adapter is None:  # base rows: judged against the logits themselves
                err = (got[i].double() - ref.double()).norm().item() / max(
                    ref.double().norm().item(), 1e-30)
            worst, effect = max(worst, err), max(effect, term / max(
                base.double().norm().item(), 1e-30))
            tol = TOL.get(dtype)
            if tol is not None and not err <= tol:
                raise AssertionError(
                    f"{what}: request {i} (adapter {r.adapter}) differs from the merged-weights "
                    f"reference: LoRA term relative error {err:.3g} (limit {tol})")
        return {"max_rel_err_lora_term_vs_merged": worst, "lora_term_rel_size": effect}

    def _run(self, tokens: list[int]) -> torch.Tensor:
        kv = KVCache(self.plain.config, len(tokens) + 1, self.dtype, self.device)
        logits = ModelRunner(self.plain, kv, None).forward_eager(
            build_extend([Request(list(tokens), None, 1)], kv, self.device))
        return logits[0].clone()

    def _merge(self, adapter: LoRAAdapter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Adds each module's ``s * B @ A`` (in float64) into the plain weights; returns the
        touched weights and their originals."""
        saved = []
        model, cfg = self.plain, self.plain.config
        w_device = self.device
        for (layer, target), m in adapter.modules.items():
            # On the weight's device: at 8B shapes a CPU float64 product per module is slow.
            delta = m.scaling * (m.b.to(w_device).double() @ m.a.to(w_device).double())
            if target == "embed_tokens":
                w, delta = model.model.embed_tokens.weight, delta.t()
            elif target == "lm_head":
                if model.lm_head.weight is model.model.embed_tokens.weight:  # tied: untie
                    model.lm_head.weight = torch.nn.Parameter(
                        model.lm_head.weight.detach().clone())
                w = model.lm_head.weight
            else:
                t = BY_NAME[target]
                mod = getattr(getattr(model.model.layers[layer], t.block), t.module)
                widths = cfg.module_shape(t.module).slice_widths
                lo = sum(widths[: t.slice])
                w = mod.weight[lo : lo + widths[t.slice]]
            saved.append((w, w.detach().clone()))
            w.data.copy_((w.double() + delta).to(w.dtype))
        return saved


def _unwrapped(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A deep copy of ``model`` with every LoRA wrapper replaced by its base layer (the
    wrappers, their slot weights and backend are swapped out for the copy, not copied)."""
    swapped = []
    for parent in [model.model, model] + [m for layer in model.model.layers
                                           for m in (layer.self_attn, layer.mlp)]:
        for name, child in list(parent.named_children()):
            if hasattr(child, "base") and hasattr(child, "lora"):
                swapped.append((parent, name, child))
                setattr(parent, name, child.base)
    try:
        return copy.deepcopy(model)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
