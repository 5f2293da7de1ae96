from lora_runtime.lora.adapters.adapter import AdapterError, LoRAAdapter, ModuleLoRA
from lora_runtime.lora.adapters.peft_format import load_peft_adapter, save_peft_adapter
from lora_runtime.lora.adapters.random_adapter import random_adapter

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "ModuleLoRA",
    "load_peft_adapter",
    "random_adapter",
    "save_peft_adapter",
]
