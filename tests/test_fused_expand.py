"""Expands inside their consumers (``kernels/lora_epilogue.py``): gate_up's in SwiGLU's
activation (by rows and by blocks), qkv's in RoPE with the KV write (by rows), or each as a
float32 delta expanded beforehand; o_proj's and down's as a delta that the next RMSNorm adds.
Each fused kernel against float64 and against the separate expand followed by the consumer,
on random layouts (decode and prefill rows, the neutral slot, rank-0 slices, padding rows of a
static view, NaN where the shrink leaves ``a`` undefined); then the model with each path
forced on, eager and in graph replays, against the merged-model oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU, kernel_examples
from float64_reference import TOL, lora_delta_f64, rel_err
from graph_harness import Harness, prefill_then_decode
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.norm_scratch as norm_scratch_module
import kernels.rms_norm as norm_module
import kernels.rope_kv as rope_module
import kernels.shrink_expand as shrink_expand_module
import kernels.silu_mul as silu_module
from kernels import (
    LoRAWeights,
    SegmentLayout,
    StaticSegmentLayout,
    config,
    lora_shrink,
    plan_segments,
)
from kernels.expand import lora_expand
from kernels.lora_epilogue import LoRADelta, PendingLoRA
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_and_cache_kv
from kernels.row_lora import UnshrunkLoRA
from kernels.silu_mul import silu_mul
from lora_runtime.model.backend import use_base_backend

EXAMPLES = kernel_examples(gpu=25, cpu=6)
ROPE_EXAMPLES = kernel_examples(gpu=25, cpu=4)  # its interpreted programs are the slowest
CONSUMERS = ("rope", "silu_mul", "norm")
EPILOGUES = {"rows": dict.fromkeys(CONSUMERS, 10**9),
             "blocks": dict.fromkeys(CONSUMERS, -1),
             "delta": dict.fromkeys(CONSUMERS, 10**9),
             "unshrunk": dict.fromkeys(CONSUMERS, -1)}
"""``config.ROW_EPILOGUE_MAX_ROWS`` forcing each program shape; "delta": the term expanded
beforehand into a float32 delta (``LoRADelta``) that the consumer adds elementwise;
"unshrunk": the consumer computes the shrink too (``UnshrunkLoRA``: by rows at any size)."""


UNSHRUNK = ("unshrunk", "unshrunk_blocks")
"""SwiGLU's unshrunk term forced by rows or by blocks (``config.UNSHRUNK_BLOCKS_MIN_ROWS``)."""


def _force_epilogue(monkeypatch, epilogue: str) -> None:
    """The program shape ``epilogue`` names at every row count, eager or not (an eager
    forward may otherwise take a pending term by rows: ``config.EAGER_EPILOGUE_MAX_ROWS``).
    "windows": RoPE's pending term by windows (``config.PENDING_WINDOWS_MIN_ROWS``), which
    every other shape leaves off, "windows_wide" by windows of ``config.ROPE_WIDE_WINDOW``
    rows; "blocks_wide": SwiGLU's by blocks of ``config.WIDE_BLOCK`` rows (several slots a
    block), which every other shape leaves off."""
    windows = epilogue.startswith("windows")
    monkeypatch.setattr(config, "ROW_EPILOGUE_MAX_ROWS",
                        EPILOGUES["blocks" if windows else epilogue.split("_")[0]])
    for limits in (config.PENDING_WINDOWS_MIN_ROWS, config.GRAPH_WINDOWS_MIN_ROWS):
        monkeypatch.setitem(limits, "rope", 0 if windows else 10**9)
    monkeypatch.setattr(config, "EAGER_EPILOGUE_MAX_ROWS", 10**9 * (epilogue == "rows"))
    blocks = epilogue == "unshrunk_blocks"
    monkeypatch.setattr(config, "unshrunk_by_blocks", lambda rows, consumer, seg: blocks)
    monkeypatch.setattr(config, "wide_blocks",
                        lambda rows, block_m: epilogue in ("blocks_wide", "windows_wide"))
    # 32-row wide blocks: a draw's 1-40 rows then span one or two blocks of several slots.
    monkeypatch.setattr(config, "WIDE_BLOCK", (32, *config.WIDE_BLOCK[1:]))
    monkeypatch.setattr(config, "ROPE_WIDE_WINDOW", 32)


def _tol_against_separate(dtype, epilogue: str, k: int) -> float:
    """Tolerance of a fused consumer against the separate expand then the consumer. An
    unshrunk term's consumer computes ``a`` itself, summing over the input's ``k`` columns in
    another order than the split-K shrink whose ``a`` the separate path expands; the two
    sums' difference grows like sqrt(k) (fp32 at k = 8216 on the interpreter: 0.23 of the
    flat tolerance; an H200 run of the by-windows SwiGLU exceeded it). The float64 check
    after it keeps the flat one."""
    return TOL[dtype] * (max(1.0, (k / 256) ** 0.5) if epilogue in UNSHRUNK else 1.0)


def _term(epilogue: str, lora: PendingLoRA, x: torch.Tensor):
    """The consumer's ``lora`` argument: the pending term, its delta as
    ``LoRABackend.linear_delta`` builds it (the expand into zeros), or the input ``x`` for
    the consumer to shrink."""
    if epilogue in UNSHRUNK:
        return UnshrunkLoRA(x, lora.weights, lora.layout)
    if epilogue != "delta":
        return lora
    delta = torch.zeros(lora.a.shape[0], lora.weights.lora_b.shape[1], device=DEVICE)
    lora_expand(lora.a, lora.weights, delta, lora.layout)
    return LoRADelta(delta)


def _weights(g, slots: int, k: int, widths: list[int], max_rank: int, dtype) -> LoRAWeights:
    w = LoRAWeights.for_linear(slots, k, widths, max_rank, dtype, DEVICE)
    n = len(widths)
    w.lora_a.copy_(torch.randn(w.lora_a.shape, generator=g) * k**-0.5)
    w.lora_b.copy_(torch.randn(w.lora_b.shape, generator=g) * max_rank**-0.5)
    w.ranks[:slots] = torch.randint(0, max_rank + 1, (slots, n), generator=g, dtype=torch.int32)
    w.scalings[:slots] = torch.rand(slots, n, generator=g) + 0.5
    return w


def _draw_problem(data, g, widths_of, dtype, long_k: bool = False):
    """A random layout (padded rows of the neutral slot included), weights of slices
    ``widths_of(max_rank)``, and ``a`` from the shrink with NaN wherever it is undefined.
    ``long_k``: an input width the by-rows shrink covers in several steps, the last partial
    (``config.row_shrink_k_block``)."""
    slots = data.draw(st.integers(1, 4))
    max_rank = data.draw(st.sampled_from([4, 16, 32] + ([64] if ON_GPU else [])))
    widths = widths_of(data)
    k = data.draw(st.sampled_from([32, 2 * config.row_shrink_k_block(max_rank, 4096) + 24])
                  ) if long_k else 32
    # request slots; slot `slots` is the neutral one
    requests = data.draw(st.lists(st.integers(0, slots), min_size=1, max_size=40))
    lens = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 5), min_size=len(requests),
                                                   max_size=len(requests))))
    return _problem(g, slots, max_rank, widths, k, requests, lens, data.draw(st.integers(0, 7)),
                    dtype)


def _problem(g, slots, max_rank, widths, k, requests, lens, pad, dtype, ranks=None):
    """``_draw_problem``'s problem from given values; ``ranks``: every slot's rank in every
    slice (default: random)."""
    plan = plan_segments(requests, lens, block_m=16, skip_slot=slots)
    rows = plan.num_rows
    padded = rows + pad
    layout = _layout(plan, rows, padded, slots)
    token_slots = plan.token_slots + [slots] * (padded - rows)
    w = _weights(g, slots, k, widths, max_rank, dtype)
    if ranks is not None:
        w.ranks[:slots] = ranks
    x = torch.randn(padded, k, generator=g).to(dtype).to(DEVICE)
    a = lora_shrink(x, w, layout)
    # Hazard poison: what the shrink leaves undefined must never reach the output.
    neutral = torch.tensor([s == slots for s in token_slots], dtype=torch.bool, device=DEVICE)
    a[neutral] = float("nan")
    for slot in range(slots):
        rows_of = torch.tensor([s == slot for s in token_slots], dtype=torch.bool,
                               device=DEVICE)
        for sl in range(len(widths)):
            r = int(w.ranks[slot, sl])
            a[rows_of, sl * max_rank + r: (sl + 1) * max_rank] = float("nan")
    return x, w, layout, token_slots, PendingLoRA(a, w, layout)


def _layout(plan, rows: int, padded: int, slots: int):
    if padded == rows:
        return SegmentLayout.from_plan(plan, DEVICE)
    static = StaticSegmentLayout(padded, slots + 1, plan.block_m, slots, DEVICE)
    static.write(plan, padded)
    return static.view(padded)


@pytest.mark.parametrize("epilogue", [*EPILOGUES, "unshrunk_blocks", "blocks_wide"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_fused_silu_mul_matches_expand_then_activation(monkeypatch, epilogue, dtype, data, seed):
    """Unshrunk by blocks: one column group a program or a group of several tiles. Wide
    blocks: 64 rows of up to 40 requests' slots."""
    _force_epilogue(monkeypatch, epilogue)
    monkeypatch.setattr(config, "ROW_SHRINK_PROGRAMS", data.draw(st.sampled_from([0, 10**9])))
    monkeypatch.setattr(config, "BLOCK_SHRINK_PROGRAMS", data.draw(st.sampled_from([1, 10**9])))
    monkeypatch.setattr(config, "PENDING_SILU_TILES", data.draw(st.sampled_from([1, 3])))
    g = torch.Generator().manual_seed(seed)
    inter = data.draw(st.sampled_from([16, 40, 136] + ([1000] if ON_GPU else [])))
    x, w, layout, token_slots, lora = _draw_problem(data, g, lambda d: [inter, inter], dtype,
                                                    long_k=epilogue in UNSHRUNK)
    y = torch.randn(x.shape[0], 2 * inter, generator=g).to(dtype).to(DEVICE)
    got = silu_mul(y, _term(epilogue, lora, x))
    assert got.shape == (x.shape[0], inter) and torch.isfinite(got).all()
    want = silu_mul(lora.apply(y.clone()))
    tol = _tol_against_separate(dtype, epilogue, x.shape[1])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    gu = y.double().cpu() + lora_delta_f64(x, w, token_slots)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert rel_err(got, ref) <= 4 * TOL[dtype]


def test_unshrunk_blocks_keep_each_slots_shrink_to_its_own_rows(monkeypatch):
    """A 16-row window holding rows of three slots (every rank set): SwiGLU's unshrunk term by
    blocks gives each row its own slot's ``x @ A^T`` only (the random draws above meet such a
    window in some runs, not all)."""
    _force_epilogue(monkeypatch, "unshrunk_blocks")
    g = torch.Generator().manual_seed(3)
    inter, k = 16, 32
    x, w, layout, token_slots, lora = _problem(g, 3, 16, [inter, inter], k, [0, 1, 2],
                                               [3, 4, 5], 2, torch.float32, ranks=8)
    assert len(set(token_slots[:16]) - {3}) == 3, "one window must hold all three slots"
    y = torch.randn(x.shape[0], 2 * inter, generator=g).to(DEVICE)
    got = silu_mul(y, _term("unshrunk_blocks", lora, x))
    gu = y.double().cpu() + lora_delta_f64(x, w, token_slots)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert rel_err(got, ref) <= 4 * TOL[torch.float32]


def test_wide_blocks_only_for_extend_layouts():
    """Decode layouts (16-row blocks) of many adapters would put several slots in a wide
    block; extend layouts (64-row blocks) of enough rows take them."""
    at = config.WIDE_BLOCKS_MIN_ROWS
    assert config.wide_blocks(at, 64)
    assert not config.wide_blocks(at - 1, 64)
    assert not config.wide_blocks(4 * at, 16)


@pytest.mark.parametrize("maxnreg", [0, 128])
def test_wide_blocks_launch_with_the_register_cap(monkeypatch, maxnreg):
    """``config.WIDE_MAXNREG`` reaches the wide-block SwiGLU launch (0: no cap passed), and
    never the 16-row blocks' launch; the result is the separate expand's either way."""
    monkeypatch.setattr(config, "WIDE_MAXNREG", maxnreg)
    launches = []
    real = silu_module.launch

    def recorded(kernel, grid, *args, **kwargs):
        launches.append((kwargs.get("BLOCK_M"), kwargs.get("maxnreg")))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(silu_module, "launch", recorded)
    g = torch.Generator().manual_seed(3)
    inter, slots, r, k = 64, 3, 16, 32
    w = _weights(g, slots, k, [inter, inter], r, torch.float32)
    plan = plan_segments([0, 1, 2], [40, 30, 20], block_m=64, skip_slot=slots)
    layout = SegmentLayout.from_plan(plan, DEVICE)
    x = torch.randn(90, k, generator=g).to(DEVICE)
    lora = PendingLoRA(lora_shrink(x, w, layout), w, layout)
    y = torch.randn(90, 2 * inter, generator=g).to(DEVICE)
    want = silu_mul(lora.apply(y.clone()))
    for wide in (True, False):
        monkeypatch.setattr(config, "wide_blocks", lambda rows, block_m, wide=wide: wide)
        launches.clear()
        got = silu_mul(y, lora)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        blocks = [(m, n) for m, n in launches if m is not None]
        cap = maxnreg if wide and maxnreg else None
        assert blocks == [(config.WIDE_BLOCK[0] if wide else 16, cap)], launches


def _rope_f64(x, pos, cos, sin):
    """Rotate-half RoPE in float64 from the tables' first half: x [T, H, D]."""
    half = x.shape[-1] // 2
    c, s = cos[pos, :half].double()[:, None, :], sin[pos, :half].double()[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1)


@pytest.mark.parametrize("epilogue", [*EPILOGUES, "windows", "windows_wide"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=ROPE_EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_rope_with_the_qkv_term_matches_expand_then_rope(monkeypatch, epilogue, dtype, data,
                                                         seed):
    """By rows, by windows of permuted rows, as a delta, and (``blocks``) the separate
    expand into a copy. Unshrunk: a program per head, or per group of up to 8 heads (the
    last partial)."""
    _force_epilogue(monkeypatch, epilogue)
    by_windows = _count_calls(monkeypatch, rope_module, "rope_kv_lora_windows_op")
    monkeypatch.setattr(config, "ROW_SHRINK_PROGRAMS", data.draw(st.sampled_from([0, 10**9])))
    g = torch.Generator().manual_seed(seed)
    kv_heads, group = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 3]))
    head_dim = data.draw(st.sampled_from([8, 16] + ([128] if ON_GPU else [])))
    heads = kv_heads * group
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    x, w, layout, token_slots, lora = _draw_problem(data, g, lambda d: widths, dtype,
                                                    long_k=epilogue == "unshrunk")
    t = x.shape[0]
    qkv = torch.randn(t, sum(widths), generator=g).to(dtype).to(DEVICE)
    ang = torch.arange(64).double()[:, None] * torch.rand(head_dim // 2, generator=g).double()
    cos = ang.cos().repeat(1, 2).float().to(DEVICE)
    sin = ang.sin().repeat(1, 2).float().to(DEVICE)
    pos = torch.randint(0, 64, (t,), generator=g).to(DEVICE)
    slots = t + 5
    loc = (torch.randperm(slots - 1, generator=g)[:t] + 1).to(DEVICE)

    def caches():
        return [torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype,
                           device=DEVICE) for _ in range(2)]

    (k_got, v_got), (k_want, v_want) = caches(), caches()
    qkv_in = qkv.clone()
    q = rope_and_cache_kv(qkv, pos, cos, sin, loc, k_got, v_got, heads, _term(epilogue, lora, x))
    assert torch.equal(qkv, qkv_in), "qkv is an input: the term is added to a copy or in registers"
    q_want = rope_and_cache_kv(lora.apply(qkv.clone()), pos, cos, sin, loc, k_want, v_want,
                               heads)
    tol = _tol_against_separate(dtype, epilogue, x.shape[1])
    for got, want in ((q, q_want), (k_got[loc], k_want[loc]), (v_got[loc], v_want[loc])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert k_got[untouched].isnan().all() and v_got[untouched].isnan().all()
    full = qkv.double().cpu() + lora_delta_f64(x, w, token_slots)
    q64, k64, v64 = full.split(widths, 1)
    pos, cos, sin = pos.cpu(), cos.cpu(), sin.cpu()
    assert rel_err(q, _rope_f64(q64.reshape(t, heads, head_dim), pos, cos, sin)) \
        <= 4 * TOL[dtype]
    assert rel_err(k_got[loc], _rope_f64(k64.reshape(t, kv_heads, head_dim), pos, cos, sin)) \
        <= 4 * TOL[dtype]
    assert rel_err(v_got[loc], v64.reshape(t, kv_heads, head_dim)) <= 4 * TOL[dtype]
    assert len(by_windows) == epilogue.startswith("windows")


@pytest.mark.parametrize("epilogue", ["rows", "unshrunk", "windows", "unshrunk_windows",
                                      "split"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16), with_residual=st.booleans())
def test_norm_with_a_term_matches_expand_then_norm(monkeypatch, epilogue, dtype, data, seed,
                                                   with_residual):
    """o_proj's or down's term, pending or unshrunk, added by rows, by rows split over
    column groups or by windows (the last program of a row or window normalises it) before
    the residual add and the norm; without a residual, added to a copy first."""
    windows, split = epilogue.endswith("windows"), epilogue == "split"
    monkeypatch.setattr(config, "PENDING_WINDOWS_MIN_ROWS", {"norm": 0 if windows else 10**9})
    monkeypatch.setattr(config, "unshrunk_by_blocks", lambda rows, consumer, seg: windows)
    monkeypatch.setattr(config, "unshrunk_by_rows", lambda rows, rank: not windows)
    monkeypatch.setattr(config, "norm_rows_split", lambda x: split)
    if split:  # column groups of 32: several a row, the last one partial
        monkeypatch.setattr(config, "row_block_n", lambda block_r: 32)
    epilogue = epilogue.removesuffix("_windows").replace("windows", "rows").replace("split",
                                                                                   "rows")
    by_windows = _count_calls(monkeypatch, norm_module, "add_rms_norm_lora_windows_op")
    by_split = _count_calls(monkeypatch, norm_module, "_add_rms_norm_lora_op",
                            when=lambda a: a[4] is True)
    g = torch.Generator().manual_seed(seed)
    # By windows or split (a residual to store into), at least two column groups: the last
    # program of a window or row normalises it.
    with_residual = with_residual or windows or split
    sizes = [136, 264] if windows or split else [16, 40, 136]
    hidden = data.draw(st.sampled_from(sizes + ([4096] if ON_GPU else [])))
    x, w, layout, token_slots, lora = _draw_problem(data, g, lambda d: [hidden], dtype,
                                                    long_k=epilogue == "unshrunk")
    t = x.shape[0]
    y, res = (torch.randn(t, hidden, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    residual, y_in = res if with_residual else None, y.clone()
    got = rms_norm(y, nw, 1e-5, residual, _term(epilogue, lora, x))
    assert torch.equal(y, y_in), "x is an input: the term is added in registers or to a copy"
    want = rms_norm(lora.apply(y.clone()), nw, 1e-5, residual)
    for a, b in zip(got, want, strict=True) if with_residual else [(got, want)]:
        assert torch.isfinite(a).all()
        tol = _tol_against_separate(dtype, epilogue, x.shape[1])
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    s64 = y.double().cpu() + lora_delta_f64(x, w, token_slots)
    if with_residual:
        s64 = s64 + res.double().cpu()
        assert rel_err(got[1], s64) <= 4 * TOL[dtype]
    ref = nw.double().cpu() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(got[0] if with_residual else got, ref) <= 4 * TOL[dtype]
    assert len(by_windows) == (windows and with_residual)
    assert len(by_split) == split


def test_norm_refuses_a_term_of_several_slices():
    g = torch.Generator().manual_seed(0)
    layout = SegmentLayout.from_plan(plan_segments([0, 1], block_m=16), DEVICE)
    w = _weights(g, 2, 8, [8, 8], 4, torch.float32)
    x, y = torch.randn(2, 8, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="must have one slice"):
        rms_norm(y, torch.ones(16, device=DEVICE), 1e-5, y.clone(), UnshrunkLoRA(x, w, layout))
    with pytest.raises(ValueError, match="covers 2 rows but the input has 3"):
        rms_norm(y, torch.ones(16, device=DEVICE), 1e-5, y.clone(),
                 UnshrunkLoRA(torch.randn(3, 8, device=DEVICE), w, layout))


def test_block_args_follow_the_layout_the_input_and_the_route():
    """``block_args`` keeps what depends on the weights and the layout: a new layout, input
    or route must not reuse the last one's."""
    from kernels.row_lora import block_args

    w = LoRAWeights.for_linear(2, 8, [8], 4, torch.float32, DEVICE)
    l1, l2 = (SegmentLayout.from_plan(plan_segments(s, block_m=16), DEVICE)
              for s in ([0, 1], [1, 1, 0]))
    a1, a2, x = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3, 8)
    # The last two calls keep the layout and the route (kept constants), with a new input.
    for layout, a in ((l1, a1), (l2, a2), (l1, a1), (l1, torch.ones(2, 4))):
        got = block_args(a, w, layout, shrink=False)
        assert got[0] is a and got[2] is layout.permutation and got[3] is layout.token_slots
        assert got[13] is a, "without a shrink the A argument is the input itself"
    for src in (x, torch.ones(3, 8)):
        got = block_args(src, w, l2, shrink=True)
        assert got[0] is src and got[13] is w.lora_a and got[14] == 8


def test_rope_refuses_a_term_of_another_projection():
    g = torch.Generator().manual_seed(0)
    layout = SegmentLayout.from_plan(plan_segments([0, 1], block_m=16), DEVICE)
    w = _weights(g, 2, 8, [16, 16], 4, torch.float32)  # two slices: gate_up's shape
    lora = PendingLoRA(torch.zeros(2, 8, device=DEVICE), w, layout)
    caches = [torch.zeros(4, 1, 8, device=DEVICE) for _ in range(2)]
    tab = torch.ones(8, 8, device=DEVICE)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="not q, k, v"):
        rope_and_cache_kv(torch.randn(2, 32, device=DEVICE), ids, tab, tab, ids, *caches, 2,
                          lora)


def test_fused_silu_mul_refuses_a_term_of_another_projection():
    g = torch.Generator().manual_seed(0)
    plan = plan_segments([0, 1], block_m=16)
    layout = SegmentLayout.from_plan(plan, DEVICE)
    w = LoRAWeights.for_linear(2, 8, [24], 16, torch.float32, DEVICE)
    a = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="not gate and up"):
        silu_mul(torch.randn(2, 24, generator=g).to(DEVICE), PendingLoRA(a, w, layout))
    w2 = _weights(g, 2, 8, [12, 12], 16, torch.float32)
    with pytest.raises(ValueError, match="a must be float32"):
        silu_mul(torch.randn(2, 24, device=DEVICE), PendingLoRA(a, w2, layout))
    with pytest.raises(ValueError, match="covers 2 rows"):
        silu_mul(torch.randn(3, 24, device=DEVICE), PendingLoRA(torch.zeros(3, 32), w2, layout))


def _count_calls(monkeypatch, module, name: str, delta_at: int | None = None,
                 when=None) -> list:
    """Calls of ``module.name`` (with ``delta_at``: those given a delta at that position;
    with ``when``: those whose arguments it accepts)."""
    calls, op = [], getattr(module, name)

    def counted(*a):
        if (delta_at is None or (len(a) > delta_at and a[delta_at] is not None)) and (
                when is None or when(a)):
            calls.append(1)
        return op(*a)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_model_with_the_fused_expand_matches_the_oracle_eager_and_replayed(monkeypatch,
                                                                           epilogue):
    """Each program shape forced on for every row count (the one-launch eager path off),
    under the Triton base kernels: eager forwards and graph replays (decode and prefill
    buckets) equal each other and the merged model."""
    monkeypatch.setattr(config, "FUSED_EXPAND_MIN_ROWS", 0)
    monkeypatch.setattr(config, "ONE_LAUNCH_MAX_ROWS", 0)
    _force_epilogue(monkeypatch, epilogue)
    monkeypatch.setattr(config, "CONSUMER_SHRINK_MAX_ROWS", 10**9 * (epilogue == "unshrunk"))
    norm_calls = blocks_calls = windows = [1]
    routes = set()  # the DELTA_MAX_ROWS keys the projections asked for
    if epilogue == "unshrunk":  # eager: every term computed by its consumer, no LoRA launch
        # SwiGLU's and the norm's by rows at decode (3 rows), by blocks at prefill (12 rows)
        monkeypatch.setattr(config, "unshrunk_by_blocks", lambda rows, consumer, seg: rows > 8)
        monkeypatch.setattr(config, "unshrunk_by_rows", lambda rows, rank: rows <= 8)
        windows = _count_calls(monkeypatch, norm_module, "add_rms_norm_lora_windows_op")
        # the ops' SHRINK argument: before BLOCK_K (by blocks), before BLOCK_K, NEUTRAL (rows)
        shrinks = lambda a: a[-2] is True  # noqa: E731
        row_shrinks = lambda a: a[-3] is True  # noqa: E731
        calls = _count_calls(monkeypatch, silu_module, "_silu_mul_lora_rows_op",
                             when=row_shrinks)
        blocks_calls = _count_calls(monkeypatch, silu_module, "_silu_mul_lora_op", when=shrinks)
        rope_calls = _count_calls(monkeypatch, rope_module, "_rope_kv_lora_op",
                                  when=row_shrinks)
        norm_calls = _count_calls(monkeypatch, norm_module, "_add_rms_norm_lora_op",
                                  when=row_shrinks)
        one_launch = _count_calls(monkeypatch, shrink_expand_module, "_shrink_expand_op")
    elif epilogue == "delta":  # every projection's term as a delta, added by the next kernel
        monkeypatch.setattr(config, "delta_beside", lambda x, route: routes.add(route) or True)
        calls = _count_calls(monkeypatch, silu_module, "_silu_mul_op", delta_at=1)
        rope_calls = _count_calls(monkeypatch, rope_module, "_rope_kv_op", delta_at=8)
        norm_calls = _count_calls(monkeypatch, norm_module, "_add_rms_norm_op", delta_at=4)
    elif epilogue == "rows":  # the shrink beside the GEMM, its `a` left to every consumer
        calls = _count_calls(monkeypatch, silu_module, "_silu_mul_lora_rows_op")
        rope_calls = _count_calls(monkeypatch, rope_module, "_rope_kv_lora_op")
        norm_calls = _count_calls(monkeypatch, norm_module, "_add_rms_norm_lora_op",
                                  when=lambda a: a[-3] is False)
    else:  # graphs by blocks (qkv's, o_proj's and down's expand separate); eager forwards
        # leave those three to RoPE and the norm by rows (``config.EAGER_EPILOGUE_MAX_ROWS``)
        monkeypatch.setattr(config, "EAGER_EPILOGUE_MAX_ROWS", 10**9)
        # the norm's and RoPE's pending term by windows at prefill (12 rows; RoPE's in the
        # graph too), by rows at decode (RoPE's graph: the separate expand)
        monkeypatch.setattr(config, "PENDING_WINDOWS_MIN_ROWS", {"norm": 9, "rope": 9})
        monkeypatch.setattr(config, "GRAPH_WINDOWS_MIN_ROWS", {"rope": 9})
        blocks_calls = _count_calls(monkeypatch, norm_module, "add_rms_norm_lora_windows_op")
        windows = _count_calls(monkeypatch, rope_module, "rope_kv_lora_windows_op")
        calls = _count_calls(monkeypatch, silu_module, "_silu_mul_lora_op")
        rope_calls = _count_calls(monkeypatch, rope_module, "_rope_kv_lora_op")
        norm_calls = _count_calls(monkeypatch, norm_module, "_add_rms_norm_lora_op",
                                  when=lambda a: a[-3] is False)
    with use_base_backend("triton"):
        h = Harness("triton", DEVICE, decode_buckets=[4], max_context=16, prefill_buckets=[24],
                    max_requests=4, slots=3, max_rank=8, dtype=torch.float32)
        ads = [h.adapter("A", 4, ["gate_proj", "up_proj", "o_proj"], seed=1),
               h.adapter("B", 8, ["up_proj", "down_proj", "q_proj"], seed=2), None]
        prefill_then_decode(h, ads, DEVICE, prefill_bucket=24, decode_bucket=4)
    assert h.replays == 3 and h.oracle_checks == 6
    assert calls, "the fused activation never ran"
    assert blocks_calls, "SwiGLU or the norm never took a term by blocks"
    assert windows, "the norm (unshrunk) or RoPE (blocks) never took a term by windows"
    assert rope_calls, "RoPE with the qkv term never ran"
    assert norm_calls, "no norm added a LoRA term"
    if epilogue == "delta":  # o_proj and down each under their own threshold
        assert routes == {"rope", "norm", "silu_mul", "down"}, routes
    assert epilogue != "unshrunk" or not one_launch, "an eager LoRA term was launched"


@pytest.mark.slow
def test_graphs_with_the_norms_term_by_split_rows_and_windows_match_the_oracle(monkeypatch):
    """o_proj and down leave their expand to the norm inside graphs: by rows split over
    column groups in the decode graph (``ROW_EPILOGUE_MAX_ROWS["norm"]``, ``NORM_ROWS_SPLIT``),
    by windows in the prefill graph (``GRAPH_WINDOWS_MIN_ROWS["norm"]``). Replays equal
    eager forwards and the merged model, and the scratch the norms share is left as found."""
    monkeypatch.setitem(config.ROW_EPILOGUE_MAX_ROWS, "norm", 8)
    monkeypatch.setattr(config, "NORM_ROWS_SPLIT", True)
    monkeypatch.setitem(config.GRAPH_WINDOWS_MIN_ROWS, "norm", 9)
    in_graph = lambda a: not config.eager(a[0])  # noqa: E731
    split = _count_calls(monkeypatch, norm_module, "_add_rms_norm_lora_op",
                         when=lambda a: in_graph(a) and a[4] is True)
    windows = _count_calls(monkeypatch, norm_module, "add_rms_norm_lora_windows_op",
                           when=in_graph)
    with use_base_backend("triton"):
        h = Harness("triton", DEVICE, decode_buckets=[4], max_context=16, prefill_buckets=[24],
                    max_requests=4, slots=3, max_rank=8, dtype=torch.float32)
        ads = [h.adapter("A", 4, ["o_proj", "up_proj"], seed=1),
               h.adapter("B", 8, ["down_proj", "q_proj"], seed=2), None]
        prefill_then_decode(h, ads, DEVICE, prefill_bucket=24, decode_bucket=4)
    assert h.replays == 3 and h.oracle_checks == 6
    assert split, "no decode graph's norm took o_proj's or down's term by split rows"
    assert windows, "no prefill graph's norm took o_proj's or down's term by windows"
    assert all(int(count.count_nonzero()) == 0
               for count, _ in norm_scratch_module._scratch.values())


@pytest.mark.skipif(not ON_GPU, reason="a CUDA graph keeps the scratch's addresses")
@pytest.mark.parametrize("route", ["windows", "split"])
def test_a_graph_replays_the_norm_after_its_scratch_is_outgrown(monkeypatch, route):
    """A graph captured with the norm's term by windows or split rows keeps its scratch's
    addresses: when a later, larger forward outgrows the scratch, the old one must stay
    allocated and zero (a freed one is reused and overwritten: the replay then misreads its
    counters). The route runs eagerly first, so the scratch sits outside the graph's pool."""
    if route == "windows":
        monkeypatch.setitem(config.GRAPH_WINDOWS_MIN_ROWS, "norm", 0)
        monkeypatch.setitem(config.PENDING_WINDOWS_MIN_ROWS, "norm", 0)
    else:
        monkeypatch.setattr(config, "norm_rows_split", lambda x: True)
    g = torch.Generator().manual_seed(3)
    x, w, layout, _, lora = _problem(g, 3, 16, [4096], 64, [0, 1, 2, 1] * 4, None, 0,
                                     torch.bfloat16)
    y, res = (torch.randn(x.shape[0], 4096, generator=g).to(torch.bfloat16).to(DEVICE)
              for _ in range(2))
    nw = (1 + 0.1 * torch.randn(4096, generator=g)).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setattr(norm_scratch_module, "_scratch", {})  # the smallest scratch there is
    rms_norm(y, nw, 1e-5, res, lora)
    (first,) = norm_scratch_module._scratch.values()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = rms_norm(y, nw, 1e-5, res, lora)
    torch.cuda.current_stream().wait_stream(stream)
    # An eager forward of more windows than the first scratch counts outgrows it...
    gx, gw, glayout, _, glora = _problem(g, 3, 16, [4096], 64, [0, 1, 2] * 5600, None, 0,
                                         torch.bfloat16)
    big = torch.randn(gx.shape[0], 4096, device=DEVICE, dtype=torch.bfloat16)
    rms_norm(big, nw, 1e-5, big.clone(), glora)
    (grown,) = norm_scratch_module._scratch.values()
    assert all(a is not b for a, b in zip(first, grown, strict=True)), "nothing was outgrown"
    old = {t.data_ptr() for t in first}
    del first, grown
    # ...and whatever the allocator hands out next is filled with garbage: counts no program
    # reaches (a replay on them would normalise nothing). New inputs: a replay misled by its
    # counters would otherwise reuse the capture's sums, still right.
    junk = [torch.full((1024,), 1 << 20, dtype=torch.int32, device=DEVICE)
            for _ in range(2048)]
    for t in (y, res):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    # The hazard itself: the replay wrote memory the allocator had handed to someone else.
    reused = [j for j in junk if j.data_ptr() in old]
    assert not reused, "the outgrown scratch was freed and handed out again"
    assert all(bool((j == 1 << 20).all()) for j in junk), "the replay wrote into freed memory"
    del junk
    want = rms_norm(y, nw, 1e-5, res, lora)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
