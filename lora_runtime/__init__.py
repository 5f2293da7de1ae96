"""Lean multi-LoRA runtime: batch metadata, LoRA backends, adapter pool, guarded layers, a
Llama-architecture model, forward batches."""
