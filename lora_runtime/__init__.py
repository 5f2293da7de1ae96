"""Lean multi-LoRA runtime. ``engine/``: requests, batches, KV cache, scheduler, model runner,
the serving loop. ``lora/``: adapters, slot pool, manager, backends, guarded layers. ``model/``:
a Llama-architecture model."""

import kernels as _kernels

if getattr(_kernels, "PROJECT", None) != "multilora-graphs":
    raise ImportError(
        f"`import kernels` found {getattr(_kernels, '__file__', _kernels)!r}, which is not this "
        "project's kernels package: Hugging Face's `kernels` (required by transformers >= 5.25) "
        "has the same import name. Install this project in a virtual environment without it "
        "(transformers < 5.25), or run from the repository root so that its `kernels/` comes first."
    )
