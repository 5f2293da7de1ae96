"""Faults the bench-verification tests inject (each a monkeypatch), shared by their files."""

from __future__ import annotations

from lora_runtime.model import attention_ops


def third_request_one_position_off(monkeypatch, module) -> None:
    """``module.build_decode`` (as that module imported it) gives the third request of a
    decode batch of 4 or more the next position."""
    real = module.build_decode

    def build(reqs, kv, device, *a, **k):
        batch = real(reqs, kv, device, *a, **k)
        if batch.batch_size >= 4:
            batch.positions[2] += 1
        return batch

    monkeypatch.setattr(module, "build_decode", build)


def mask_by_longest(monkeypatch) -> None:
    """Decode attention (torch kernels) lets every request read as many slots as the longest."""
    real = attention_ops.decode_attention_reference

    def masked(q, k_cache, v_cache, meta, scale):
        longest = meta.kv_lens.max().expand_as(meta.kv_lens)
        return real(q, k_cache, v_cache, type(meta)(meta.kv_indices, longest), scale)

    monkeypatch.setattr(attention_ops, "decode_attention_reference", masked)
