"""Lean multi-LoRA runtime. ``engine/``: requests, batches, KV cache, scheduler, model runner,
the serving loop. ``lora/``: adapters, slot pool, manager, backends, guarded layers. ``model/``:
a Llama-architecture model."""
