"""LoRA: target modules, adapters, slot pool, manager, backends (batch metadata), guarded layers."""
