"""A Llama-architecture decoder (RMSNorm, RoPE, GQA with a KV cache, SwiGLU). Plain
``nn.Linear``/``nn.Embedding`` layers; ``LoRAManager`` wraps the target modules."""

from __future__ import annotations

import torch
from torch import nn

from lora_runtime.dp.collectives import gather_rows, reduce_scatter_rows
from lora_runtime.dp.group import DPGroup
from lora_runtime.engine.forward_batch import ForwardBatch
from lora_runtime.model.attention import LlamaAttention
from lora_runtime.model.config import LlamaConfig
from lora_runtime.model.layers import RMSNorm, RotaryEmbedding, deferred, silu_mul

SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_dtype(dtype) -> None:
    if dtype not in SERVED_DTYPES:
        # A string ("bfloat16", as transformers takes) was read as a device by Module.to;
        # float8 failed in the range check or at the first forward (no float8 kernels).
        raise TypeError(f"dtype must be a floating torch.dtype the model computes in "
                        f"({', '.join(map(str, SERVED_DTYPES))}), got {dtype!r}")


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.dp: DPGroup | None = None
        """Set by ``lora_runtime.dp.shard.shard_mlp``: this rank holds 1/size of the
        intermediate dimension and runs on the rows gathered from every rank."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch):
        """``(output, LoRA term or None)``, as ``LlamaAttention.forward``. Under DP down's LoRA
        term is summed by the reduce-scatter with its base output, so it is never left to the
        norm."""
        if self.dp is None:
            return self._local(x, delta=True)
        rows = gather_rows(x, batch.gathered.rows_per_rank, self.dp)
        out, _ = self._local(rows, delta=False)
        return reduce_scatter_rows(out, self.dp)[: x.shape[0]], None

    def _local(self, x: torch.Tensor, delta: bool):
        h = silu_mul(*deferred(self.gate_up_proj, x))
        return deferred(self.down_proj, h) if delta else (self.down_proj(h), None)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, residual, batch: ForwardBatch, kv, delta=None):
        """``(hidden, residual, delta)`` -> the same triple after this layer. The residual
        stream is carried unsummed: each norm adds the previous block's output (and its LoRA
        delta, if the block left one) into it in one fused kernel, and the first layer starts
        it (``residual`` None)."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual, delta)
        hidden, delta = self.self_attn(x, batch, kv)
        x, residual = self.post_attention_layernorm(hidden, residual, delta)
        hidden, delta = self.mlp(x, batch)
        return hidden, residual, delta


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        hidden, residual, delta = self.embed_tokens(batch.input_ids), None, None
        for layer in self.layers:
            hidden, residual, delta = layer(hidden, residual, batch, kv, delta)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual, delta)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dp(self) -> DPGroup | None:
        """The DP group when the MLP is sharded for data-parallel attention."""
        layers = self.model.layers
        return layers[0].mlp.dp if len(layers) else None

    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        """Logits of the rows in ``batch.logits_rows``, in the model's dtype: the lm_head's
        output as computed. A float32 copy would be exact but cost a pass over bs x vocab
        (97 us at bs=256 on an H200); greedy sampling needs none, and a sampler that does
        upcasts what it reads."""
        hidden = self.model(batch, kv)
        return self.lm_head(hidden[batch.logits_rows].contiguous())

    @staticmethod
    def empty(config: LlamaConfig, dtype: torch.dtype, device) -> LlamaForCausalLM:
        """Uninitialised weights on ``device`` (no host copy, no init cost), rotary filled."""
        check_dtype(dtype)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device=device).to(dtype)
        model.model.rotary.cos = model.model.rotary.cos.float()
        model.model.rotary.sin = model.model.rotary.sin.float()
        model.model.rotary.fill()
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    @staticmethod
    def random(config: LlamaConfig, dtype: torch.dtype, device, seed: int = 0):
        return LlamaForCausalLM.empty(config, dtype, device).init_random(seed)

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
        """Random weights (benchmarks, tests): normal(0, std) matrices, norms near one."""
        for i, (name, p) in enumerate(self.named_parameters()):
            g = torch.Generator(device=p.device).manual_seed(seed * 1000 + i)
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * std)
        return self
