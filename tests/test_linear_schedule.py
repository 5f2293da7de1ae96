"""LoRA linears in every schedule (``linear_schedule``): the same output up to one rounding of
the shrink's output, and base + LoRA against float64; on the GPU, inside CUDA graphs whose
side branch must be joined before the output is read.

Not bit for bit: a split-K shrink adds its splits with float atomics in no fixed order, so two
runs of one schedule may round ``a`` to the weights' dtype one unit apart (seen on the H200:
one element of ``a`` in a bf16 replay, 136 outputs one unit off)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from float64_reference import TOL, lora_delta_f64, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import linear_cases

from kernels import config, lora_expand, lora_shrink
from kernels.reference import expand_reference, shrink_reference
from lora_runtime.lora.backends import RowSet
from lora_runtime.lora.backends.triton_backend import TritonBackend
from lora_runtime.lora.batch_info import LOGITS_BLOCK_M, LoRABatchInfo
from lora_runtime.lora.linear_schedule import SCHEDULES, lora_linear, schedule_for

KERNELS = {
    "triton": (lambda x, c: lora_shrink(x, c.weights, c.layout),
               lambda a, y, c: lora_expand(a, c.weights, y, c.layout)),
    "torch": (lambda x, c: shrink_reference(x, c.weights, c.layout),
              lambda a, y, c: expand_reference(a, c.weights, y, c.layout)),
}


def _problem(case, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows, k = len(case.token_slots), case.weights.lora_a.shape[2]
    n = case.weights.lora_b.shape[1]
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    return x, w


def _assert_same_up_to_a_rounding(got, want, lora_term):
    """``got`` equals ``want`` but for outputs one rounding of ``a`` apart: within the dtype's
    eps of the LoRA term's size. A missing or half-added LoRA term is far outside that."""
    eps = torch.finfo(want.dtype).eps
    atol = eps * lora_term.abs().max().item()
    torch.testing.assert_close(got, want, rtol=eps, atol=atol)


def _run(kernels, case, x, w, schedule):
    shrink, expand = kernels
    return lora_linear(lambda v: v @ w.t(), x, lambda v: shrink(v, case),
                       lambda a, y: expand(a, y, case), schedule)


@pytest.mark.parametrize("provider", list(KERNELS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@settings(max_examples=15)
@given(data=st.data())
def test_every_schedule_gives_the_in_place_result(provider, dtype, data):
    case = data.draw(linear_cases(dtype, DEVICE))
    x, w = _problem(case, dtype, data.draw(st.integers(0, 2**31)))
    serial = _run(KERNELS[provider], case, x, w, "serial")
    want = (x.double() @ w.double().t()).cpu() + lora_delta_f64(x, case.weights, case.token_slots)
    assert rel_err(serial.cpu(), want) < TOL[dtype]
    lora_term = serial.double() - (x.double() @ w.double().t())
    for schedule in SCHEDULES:
        got = _run(KERNELS[provider], case, x, w, schedule)
        if provider == "torch" or not (lora_term != 0).any():
            assert torch.equal(got, serial), f"{schedule} differs from the serial order"
        else:
            _assert_same_up_to_a_rounding(got, serial, lora_term)


def test_unknown_schedule_names_the_choices():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="one of .'beside', 'serial'."):
        lora_linear(lambda v: v, x, lambda v: v, lambda a, y: None, "overlap")


def test_outside_a_capture_everything_runs_in_order():
    assert schedule_for(torch.ones(1, 4, device=DEVICE)) == "serial"


@pytest.mark.skipif(not ON_GPU, reason="CUDA graph branches need a GPU")
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_graph_branches_join_before_the_output_is_read(schedule, rows):
    """Replays over new inputs must equal eager: a side branch joined too late (or not at all)
    leaves the GEMM's output without its LoRA term, or races it."""
    from kernel_cases import Case

    from kernels import LoRAWeights, SegmentLayout, plan_segments

    dtype = torch.bfloat16
    k, widths, slots = 1024, [2048, 512, 512], 4
    weights = LoRAWeights.for_linear(slots, k, widths, 16, dtype, DEVICE)
    weights.lora_a.normal_(0, k**-0.5)
    weights.lora_b.normal_(0, 0.25)
    weights.ranks[:slots] = torch.tensor([[16, 8, 0], [4, 16, 16], [0, 0, 0], [16, 16, 16]],
                                         dtype=torch.int32)
    weights.scalings[:slots] = 2.0
    token_slots = [t % (slots + 1) for t in range(rows)]  # the neutral slot included
    layout = SegmentLayout.from_plan(plan_segments(token_slots, None, block_m=16,
                                                   skip_slot=slots), DEVICE)
    case = Case(weights, layout, token_slots, None)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn(sum(widths), k, dtype=dtype, device=DEVICE) * k**-0.5
    graph = torch.cuda.CUDAGraph()
    out = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(KERNELS["triton"], case, x, w, schedule)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out["y"] = _run(KERNELS["triton"], case, x, w, schedule)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = _run(KERNELS["triton"], case, x, w, "serial")
        _assert_same_up_to_a_rounding(out["y"], want, want.double() - x.double() @ w.double().t())


@pytest.mark.parametrize(("rows", "blocks", "max_rank", "want"), [
    (16, 16, 256, True),  # up to 16 rows: one launch whatever the pool
    (64, 16, 16, True),  # 16 blocks x (16 + 16) re-read rows = 512
    (64, 64, 16, True),  # 2048: at the budget
    (64, 64, 64, False),  # 5120: the recomputation bound the H200 step (3.00x against 2.24x)
    (65, 1, 16, False),  # past the row limit
    (32, 0, 256, True),  # no block (every row neutral): nothing to recompute
])
def test_the_eager_one_launch_route_bounds_its_recomputation(rows, blocks, max_rank, want):
    assert config.one_launch_lora(torch.empty(rows, 8), blocks, 16, max_rank) is want


@pytest.mark.parametrize(("rows", "max_rank", "want"), [
    (1, 16, True), (64, 16, True), (64, 8, True),
    (256, 8, True), (256, 16, True),  # rows x rank block 4096: at the budget
    (257, 8, False),  # past the row limit: the one-launch or split route
    (1024, 16, False),  # the by-rows kernels bound the step (H200: 2.2x against 1.4-1.9x)
    (64, 64, True), (128, 32, True),
    (65, 64, False), (129, 32, False),  # past the rows x rank budget
    (256, 64, False),  # (the 8/16/64 pool at bs 256: 2.46x against 1.99x)
    (1, 128, False),  # each program's serial shrink grows with the rank: not measured above 64
])
def test_the_eager_consumer_shrink_is_bounded_by_rows_and_rank(rows, max_rank, want):
    """RoPE takes an unshrunk term by rows only."""
    assert config.shrink_in_consumer(torch.empty(rows, 8), max_rank, "rope", 1) is want


@pytest.mark.parametrize(("rows", "blocks", "max_rank", "want"), [
    (16, 1, 64, True),  # by rows: 16 x 64 within the rows x rank budget
    (127, 1, 128, False),  # by rows, past the rank limit
    (128, 8, 64, True), (256, 16, 64, True), (1024, 64, 64, True),  # by windows
    (256, 17, 64, False),  # more blocks than windows: by rows, past its budget
    (256, 64, 16, True),  # the same, within the by-rows budget
    (1040, 8, 16, False),  # past the by-windows row limit
    (256, 1, 128, False),  # the rank limit holds by windows too
])
def test_swiglu_and_the_norm_take_the_unshrunk_term_by_windows_of_about_one_adapter(
        monkeypatch, rows, blocks, max_rank, want):
    """SwiGLU by windows wherever the layout allows it; the norm only past its by-rows
    budget and up to 256 rows (down's long shrink is repeated once a column group)."""
    monkeypatch.setattr(config, "UNSHRUNK_BLOCKS_MIN_ROWS", {"silu_mul": 128, "norm": 128})
    monkeypatch.setattr(config, "CONSUMER_SHRINK_BLOCKS_MAX_ROWS", 1024)
    monkeypatch.setattr(config, "NORM_UNSHRUNK_WINDOWS_MAX_ROWS", 256)
    x = torch.empty(rows, 8)
    assert config.shrink_in_consumer(x, max_rank, "silu_mul", blocks) is want
    by_rows = rows <= 256 and rows * config.rank_block(max_rank) <= 4096 and max_rank <= 64
    windows = rows >= 128 and blocks <= -(-rows // 16)  # the program shape, any size
    assert config.unshrunk_by_windows(rows, max_rank, "silu_mul", blocks) is windows
    norm_windows = windows and not by_rows and rows <= 256
    assert config.unshrunk_by_windows(rows, max_rank, "norm", blocks) is norm_windows
    assert config.shrink_in_consumer(x, max_rank, "norm", blocks) is (
        by_rows or (norm_windows and max_rank <= 64))


@pytest.mark.parametrize(("rows", "capturing", "want_rope", "want_norm"), [
    (63, False, False, False), (127, True, False, False),  # below both limits
    (128, False, True, True), (128, True, True, False),  # the norm by windows eager only
    (2048, True, True, False),
])
def test_the_pending_term_by_windows_route_asks_about_capture_only_past_the_limits(
        monkeypatch, rows, capturing, want_rope, want_norm):
    """RoPE takes a pending term by windows from 128 rows, eager or captured; the norm only
    eager. Below both limits the capture and tracer checks (host time on every eager layer)
    are not asked at all."""
    monkeypatch.setattr(config, "PENDING_WINDOWS_MIN_ROWS", {"norm": 128, "rope": 128})
    monkeypatch.setattr(config, "GRAPH_WINDOWS_MIN_ROWS", {"rope": 128})
    asked = []
    monkeypatch.setattr(config, "eager", lambda x: asked.append(1) or not capturing)
    x = torch.empty(rows, 8)
    assert config.pending_by_windows(x, "rope") is want_rope
    assert config.pending_by_windows(x, "norm") is want_norm
    assert bool(asked) is (rows >= 128)
    assert config.expand_in_consumer(x, "rope", 16) or not want_rope


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_a_triton_linear_takes_the_route_the_budget_allows(monkeypatch, data):
    """The backend reads the prepared layout's block count: within the budget one launch
    (``shrink_expand``), past it shrink + expand; both give base + LoRA."""
    if DEVICE == "cpu" and not config.interpreted():
        pytest.skip("the Triton LoRA backend on CPU needs TRITON_INTERPRET=1")
    case = data.draw(linear_cases(torch.float32, DEVICE))
    budget = data.draw(st.sampled_from([0, 10**6]))
    monkeypatch.setattr(config, "ONE_LAUNCH_FREE_ROWS", 0)
    monkeypatch.setattr(config, "ONE_LAUNCH_BUDGET", budget)
    backend = TritonBackend(case.weights.num_slots, DEVICE)
    backend._set(LoRABatchInfo(case.layout), None)
    x, w = _problem(case, torch.float32, data.draw(st.integers(0, 2**31)))
    launches = {"one": 0, "two": 0}
    for name, key in (("shrink_expand", "one"), ("expand", "two")):
        real = getattr(TritonBackend, name)
        monkeypatch.setattr(TritonBackend, name, lambda self, *a, real=real, key=key: (
            launches.__setitem__(key, launches[key] + 1), real(self, *a))[1])
    y = backend.linear(lambda v: v @ w.T, x, case.weights, RowSet.TOKENS)
    rows, blocks = x.shape[0], case.layout.block_slots.shape[0]
    # No block (every row neutral): nothing to recompute, within any budget.
    want_one = rows == 0 or (rows <= config.ONE_LAUNCH_MAX_ROWS and (budget > 0 or blocks == 0))
    assert launches == {"one": int(want_one), "two": int(not want_one)}, (rows, budget)
    ref = (x.double() @ w.double().T).cpu() + lora_delta_f64(x, case.weights, case.token_slots)
    assert rel_err(y.cpu(), ref) < TOL[torch.float32]


def test_the_consumer_route_is_memoised_only_for_an_eager_prepare(monkeypatch):
    """An eager ``prepare`` decides the whole-term-in-the-consumer route once per rows and
    rank for its forward; under the graph hooks every call decides for itself (a capture's
    warm-up call runs eagerly, the capture itself must not take the eager route), and a new
    batch starts a new memo."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kernels import LoRAWeights, SegmentSpec
    from lora_runtime.lora.batch_info import LoRABatchPlan

    backend = TritonBackend(2, "cpu")
    w = LoRAWeights.for_linear(2, 8, [8], 4, torch.float32, "cpu")
    spec = SegmentSpec((0, 1, 2, 0), None, 4, 2)
    plan = LoRABatchPlan(spec, dataclasses.replace(spec, block_m=LOGITS_BLOCK_M))
    x = torch.randn(4, 8)

    def decisions() -> list[bool]:
        seen = [backend.shrinks_in_consumer(x, w, "norm")]  # eager
        make_fx(lambda t: seen.append(backend.shrinks_in_consumer(t, w, "norm")) or t)(x)
        return seen

    buffers = backend.init_capture_buffers(8, 8, 4)
    backend.prepare_for_capture(buffers, 4, 4)
    assert decisions() == [True, False], "a capture's hooks must decide every call"
    backend.prepare(plan)
    assert backend.shrinks_in_consumer(x, w, "norm") and backend.routes
    monkeypatch.setattr(config, "CONSUMER_SHRINK_MAX_ROWS", 0)
    assert backend.shrinks_in_consumer(x, w, "norm"), "memoised for the prepared forward"
    backend.prepare(plan)
    assert not backend.shrinks_in_consumer(x, w, "norm"), "a new prepare decides again"
    backend.reset_batch_state()
    assert backend.routes is None


@pytest.mark.parametrize(("rows", "consumer", "max_rank", "want"), [
    (8, "rope", 128, True),  # few rows: by rows anywhere (config.ROW_EPILOGUE_MAX_ROWS)
    (64, "rope", 16, True), (1024, "norm", 16, True),  # eager: rows x rank block 16384
    (256, "norm", 64, True), (257, "norm", 64, False),  # past the rows x rank budget
    (1024, "rope", 64, False),  # (8/16/64 pool, 1024 tokens: 2.03x against 1.45x)
    (2048, "norm", 8, False),  # past the row limit (r=16, 2048 tokens: no gain)
    (64, "silu_mul", 16, False),  # SwiGLU takes a pending term by blocks there
])
def test_an_eager_pending_term_goes_to_its_consumer_by_rows_within_the_budget(
        rows, consumer, max_rank, want):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.empty(rows, 8)
    assert config.pending_by_rows(x, consumer, max_rank) is want
    traced = []
    make_fx(lambda t: traced.append(config.pending_by_rows(t, consumer, max_rank)) or t)(x)
    assert traced == [config.row_epilogue(rows, consumer)], "a trace keeps the graph's shape"


@pytest.mark.parametrize(("rows", "consumer", "num_slots", "want"), [
    (64, "rope", 64, True), (64, "silu_mul", 128, True),  # about one adapter a row
    (64, "rope", 16, False), (64, "silu_mul", 63, False),  # fewer slots than rows
    (65, "silu_mul", 128, False),  # past the pool rule's 64 rows
    (64, "norm", 64, False),  # the norm's term is never added by rows in a graph
    (63, "silu_mul", 1, True),  # few rows: by rows whatever the pool
])
def test_a_pool_with_a_slot_a_row_takes_the_term_by_rows(rows, consumer, num_slots, want):
    """In a graph (here: a trace), RoPE and SwiGLU add the term by rows up to 63 rows, and up
    to 64 when the pool holds at least as many slots as rows (H200, bs 64, 64 adapters: 30.2%
    against 37.0% over the base replay; 16 adapters kept off: 12.8 against 12.5%). The
    projection and its consumer ask the same question."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []
    make_fx(lambda t: seen.append((config.pending_by_rows(t, consumer, 16, num_slots),
                                   config.expand_in_consumer(t, consumer, 16, num_slots)))
            or t)(torch.empty(rows, 8))
    assert seen[0][0] is want and config.row_epilogue(rows, consumer, num_slots) is want
    assert seen[0][1] or not want


def test_a_capture_forks_only_forwards_up_to_the_fork_limit(monkeypatch):
    """Beside the GEMM inside a capture, for at most ``config.FORK_MAX_ROWS`` rows; larger
    forwards (GEMMs that fill the device), eager forwards and CPU tensors run in order."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(config, "FORK_MAX_ROWS", 64)

    def rows(n, device="cuda"):
        return SimpleNamespace(device=torch.device(device), shape=(n, 8))

    assert [schedule_for(rows(n)) for n in (1, 64, 65, 4096)] == ["beside", "beside",
                                                                  "serial", "serial"]
    assert schedule_for(rows(1, "cpu")) == "serial"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert schedule_for(rows(1)) == "serial"
