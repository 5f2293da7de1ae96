"""The consumers' LoRA kernels (RoPE + KV write, SwiGLU, the residual add + RMSNorm; by rows,
split rows and by windows, pending and unshrunk) and the LoRA kernels themselves (shrink,
expand, the one-launch kernel) compile for the H200 (sm_90) in bf16, checked on a machine
without a GPU: each is launched once under the interpreter on a small fp16 problem, and every
launch is compiled again for the GPU with its fp16 tensors taken as bf16
(``tests/gpu_compile.py``)."""

from __future__ import annotations

import re

import pytest
import torch
from gpu_compile import compile_for_gpu, compiled_ptx, gpu_compiler_available, recorded_launches

from kernels import (
    LoRAWeights,
    SegmentLayout,
    config,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
    plan_segments,
)
from kernels.lora_epilogue import PendingLoRA
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv
from kernels.row_lora import UnshrunkLoRA
from kernels.silu_mul import silu_mul

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not gpu_compiler_available(),
                                reason="a CPU-only check (a GPU runs the kernels themselves)")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, RANK = 4, 2, 32, 64, 48, 16


def _term(g, k: int, widths: list[int], rows: int, unshrunk: bool):
    slots = [i % 3 for i in range(rows)]
    layout = SegmentLayout.from_plan(plan_segments(slots, block_m=16, skip_slot=3), "cpu")
    w = LoRAWeights.for_linear(3, k, widths, RANK, torch.float16, "cpu")
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * k**-0.5)
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g) * RANK**-0.5)
    w.ranks[:3] = RANK
    w.scalings[:3] = 1.0
    x = torch.randn(rows, k, generator=g).half()
    return UnshrunkLoRA(x, w, layout) if unshrunk else PendingLoRA(lora_shrink(x, w, layout),
                                                                    w, layout)


def _consumers(monkeypatch, rows: int, windows: bool, unshrunk: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    limit = 0 if windows else 10**9
    monkeypatch.setattr(config, "PENDING_WINDOWS_MIN_ROWS", {"norm": limit, "rope": limit})
    monkeypatch.setattr(config, "GRAPH_WINDOWS_MIN_ROWS", {"rope": limit})
    monkeypatch.setattr(config, "ROW_EPILOGUE_MAX_ROWS", dict.fromkeys(
        ("rope", "silu_mul", "norm"), -1 if windows else 10**9))
    monkeypatch.setattr(config, "unshrunk_by_blocks", lambda r, consumer, seg: windows)
    monkeypatch.setattr(config, "unshrunk_by_rows", lambda r, rank: not windows)
    qkv_widths = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    qkv = torch.randn(rows, sum(qkv_widths), generator=g).half()
    tab = torch.randn(64, HEAD_DIM, generator=g)
    pos = torch.randint(0, 64, (rows,), generator=g)
    caches = [torch.zeros(rows + 1, KV_HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(2)]
    if not (windows and unshrunk):  # RoPE's unshrunk term has no by-windows shape
        rope_and_cache_kv(qkv, pos, tab, tab, torch.arange(1, rows + 1), *caches, HEADS,
                          _term(g, HIDDEN, qkv_widths, rows, unshrunk))
    gate_up = torch.randn(rows, 2 * INTER, generator=g).half()
    silu_mul(gate_up, _term(g, HIDDEN, [INTER, INTER], rows, unshrunk))
    y, res = (torch.randn(rows, HIDDEN, generator=g).half() for _ in range(2))
    rms_norm(y, torch.ones(HIDDEN, dtype=torch.float16), 1e-5, res,
             _term(g, INTER, [HIDDEN], rows, unshrunk))


def _lora_kernels(rows: int) -> None:
    """The shrink (split-K), the expand and the one-launch kernel."""
    g = torch.Generator().manual_seed(rows)
    term = _term(g, HIDDEN, [HIDDEN, INTER], rows, unshrunk=False)
    y = torch.randn(rows, HIDDEN + INTER, generator=g).half()
    lora_expand(term.a, term.weights, y, term.layout)
    lora_shrink_expand(torch.randn(rows, HIDDEN, generator=g).half(), term.weights, y,
                       term.layout)


@pytest.mark.slow
def test_the_lora_kernels_compile_for_the_gpu(monkeypatch):
    with recorded_launches(as_dtype={torch.float16: torch.bfloat16}) as launches:
        for windows in (False, True):
            for unshrunk in (False, True):
                with monkeypatch.context() as m:
                    _consumers(m, 20, windows, unshrunk)
        with monkeypatch.context() as m:  # the norm's pending term by split rows (graphs'),
            m.setattr(config, "norm_rows_split", lambda x: True)  # groups narrower than its
            m.setattr(config, "row_block_n", lambda block_r: 16)  # tail's step, as on the GPU
            _consumers(m, 20, False, False)
        _lora_kernels(20)
    names = {launch["name"] for launch in launches}
    for kernel in ("_rope_kv_lora_windows_kernel", "_add_rms_norm_lora_windows_kernel",
                   "_silu_mul_lora_kernel", "_rope_kv_lora_kernel", "_add_rms_norm_lora_kernel",
                   "_silu_mul_lora_rows_kernel", "_add_rms_norm_lora_split_kernel",
                   "_shrink_kernel", "_expand_kernel",
                   "_shrink_expand_kernel"):
        assert kernel in names, f"{kernel} was never launched: the routes were not forced"
    failures = compile_for_gpu(launches)
    assert not failures, "\n".join(failures)


def test_a_constexpr_lost_in_a_tuple_fails_the_gpu_compile(tmp_path):
    """The check finds what the interpreter lets through: ``tl.arange`` given a block size
    that reached it through a tuple (a compile-time constant no longer)."""
    import sys

    src = tmp_path / "lost_constexpr.py"
    src.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef _inner(p, n, BLOCK: tl.constexpr):\n"
        "    tl.store(p + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))\n\n"
        "@triton.jit\ndef bad_kernel(p, BLOCK: tl.constexpr):\n"
        "    args = (p, 1, BLOCK)\n    _inner(*args)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import lost_constexpr

        with recorded_launches() as launches:
            lost_constexpr.bad_kernel[(1,)](torch.zeros(16), BLOCK=16)
    finally:
        sys.path.remove(str(tmp_path))
    failures = compile_for_gpu(launches, extra_path=str(tmp_path))
    assert len(failures) == 1 and "constexpr" in failures[0]


def _expand_launch(widths: list[int]) -> dict:
    with recorded_launches(as_dtype={torch.float16: torch.bfloat16}) as launches:
        g = torch.Generator().manual_seed(0)
        term = _term(g, HIDDEN, widths, 20, unshrunk=False)
        y = torch.randn(20, sum(widths), generator=g).half()
        lora_expand(term.a, term.weights, y, term.layout)
    (launch,) = [x for x in launches if x["name"] == "_expand_kernel"]
    return launch


def test_the_expand_stores_y_in_16_byte_vectors():
    """The expand's only stores are y's. With every slice bound a multiple of 16 columns
    (``LoRAWeights.column_align``) the compiler is told so and stores 8 bf16 at a time; with
    bounds of no alignment (the control: same y stride) it stores them one at a time, which
    ran the prefill expand at half its bandwidth on the H200."""
    aligned, unaligned = compiled_ptx([_expand_launch([64, 32]), _expand_launch([63, 33])])

    def stores(ptx):
        return re.findall(r"st\.global(?:\.[a-z0-9]+)+", ptx)

    assert stores(aligned) and all(".v4.b32" in st for st in stores(aligned)), stores(aligned)
    assert stores(unaligned) and all(st.endswith(".b16") for st in stores(unaligned)), \
        stores(unaligned)


def _b_reading_launches(monkeypatch, max_rank: int) -> list[dict]:
    """The expand and the by-rows SwiGLU (a pending term: the decode graphs' route) over a
    pool of ``max_rank`` whose slots' ranks are below it (B's columns past them zero, as the
    slot writer leaves them); SwiGLU at a width whose row tiles give each thread 8 columns or
    more."""
    monkeypatch.setattr(config, "ROW_EPILOGUE_MAX_ROWS", dict.fromkeys(
        ("rope", "silu_mul", "norm"), 10**9))
    g = torch.Generator().manual_seed(max_rank)
    inter = 1024
    w = LoRAWeights.for_linear(3, HIDDEN, [inter, inter], max_rank, torch.float16, "cpu")
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * HIDDEN**-0.5)
    w.ranks[:3] = torch.tensor([[max_rank - 5] * 2, [3, 1], [max_rank, 2]], dtype=torch.int32)
    for s, r in enumerate(w.ranks[:3].tolist()):
        w.lora_b[s, :, :r[0]].normal_(generator=g)
    w.scalings[:3] = 0.5
    layout = SegmentLayout.from_plan(plan_segments([i % 4 for i in range(20)], block_m=16,
                                                   skip_slot=3), "cpu")
    x = torch.randn(20, HIDDEN, generator=g).half()
    with recorded_launches(as_dtype={torch.float16: torch.bfloat16}) as launches:
        a = lora_shrink(x, w, layout)
        lora_expand(a, w, torch.randn(20, 2 * inter).half(), layout)
        silu_mul(torch.randn(20, 2 * inter, generator=g).half(), PendingLoRA(a, w, layout))
    return [x for x in launches
            if x["name"] in ("_expand_kernel", "_silu_mul_lora_rows_kernel")]


@pytest.mark.slow
def test_b_loads_are_16_byte_vectors_where_max_rank_allows(monkeypatch):
    """B is read up to the pool's ``max_rank`` (a bound the compiler is told is a multiple of
    16) with ``a`` zeroed past each slot's rank: the expand and the by-rows consumers then move
    B, like y and the activations, 8 bf16 at a time. Masked by the slot's rank (loaded at run
    time) the compiler could prove nothing and read B 2 bytes at a time. Control: a
    ``max_rank`` of 13 forces 2-byte loads of B."""
    launches = _b_reading_launches(monkeypatch, 16) + _b_reading_launches(monkeypatch, 13)
    assert len(launches) == 4, [x["name"] for x in launches]
    ptx = compiled_ptx(launches)

    def scalar_16_bit(p):
        return re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*\.(?:b16|u16)\b", p)

    for launch, p in zip(launches[:2], ptx[:2], strict=True):
        assert not scalar_16_bit(p), (launch["name"], scalar_16_bit(p))
    for launch, p in zip(launches[2:], ptx[2:], strict=True):
        assert scalar_16_bit(p), launch["name"]
