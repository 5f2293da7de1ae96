"""The MLP's tensor-parallel shards under DP attention: gate_up is column-parallel (each rank
holds 1/size of the gate rows and of the up rows), down is row-parallel (the matching 1/size
of its input columns). Attention, embedding and lm_head stay whole on every rank."""

from __future__ import annotations

import torch
from torch import nn

from lora_runtime.dp.group import DPGroup
from lora_runtime.model.llama import LlamaForCausalLM


def shard_bounds(full: int, dp: DPGroup) -> tuple[int, int]:
    if full % dp.size:
        raise ValueError(f"intermediate_size {full} does not divide by the DP size {dp.size}; "
                         "choose a DP size that divides it")
    w = full // dp.size
    return dp.rank * w, (dp.rank + 1) * w


@torch.no_grad()
def shard_mlp(model: LlamaForCausalLM, dp: DPGroup) -> LlamaForCausalLM:
    """Keeps this rank's shard of every MLP (in place). Call before ``LoRAManager`` wraps the
    model: the LoRA buffers are sized from the layers they wrap. A model sharded over a group
    that ``shutdown`` has closed is pointed at ``dp`` instead (``rebind_mlp``; before a graph
    capture, whose collectives run on the model's group: a ``DPEngine`` does it too)."""
    if model.dp is not None and model.dp.closed:
        check_shard(model.dp, dp)
        rebind_mlp(model, dp)
        return model
    full = model.config.intermediate_size
    lo, hi = shard_bounds(full, dp)
    for layer in model.model.layers:
        mlp = layer.mlp
        if mlp.dp is not None:
            raise ValueError("the model's MLP is already sharded")
        if isinstance(mlp.gate_up_proj, nn.Linear) is False:
            raise ValueError("shard the model before LoRAManager wraps it")
        gu = mlp.gate_up_proj.weight
        rows = torch.cat([gu[lo:hi], gu[full + lo : full + hi]])
        mlp.gate_up_proj = _linear(rows)
        mlp.down_proj = _linear(mlp.down_proj.weight[:, lo:hi])
        mlp.dp = dp
    return model


def _linear(weight: torch.Tensor) -> nn.Linear:
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight.copy_(weight)
    return lin


def rebind_mlp(model: LlamaForCausalLM, dp: DPGroup) -> None:
    """Points the MLPs of ``model``, sharded by ``shard_mlp`` over a group that ``shutdown``
    has closed, at ``dp``: a group of the same ranks (this rank's shard is its shard there too,
    ``check_shard``). Left on the closed group, their collectives ran on a destroyed process
    group ("Could not resolve the process group"), and every rank faulted mid-step."""
    for layer in model.model.layers:
        layer.mlp.dp = dp


def check_shard(sharded: DPGroup, dp: DPGroup) -> None:
    """Raises where a model sharded over ``sharded`` cannot serve this rank of ``dp``: it holds
    another rank's (or another size's) shard of the MLP."""
    if sharded.size != dp.size:
        raise ValueError(f"the model is sharded for {sharded.size} ranks, the group has "
                         f"{dp.size}")
    if sharded.rank != dp.rank:
        raise ValueError(f"the model's MLP holds rank {sharded.rank}'s shard, but this process "
                         f"is {dp.name}: build the model again and shard it with "
                         "lora_runtime.dp.shard.shard_mlp(model, dp)")
