"""``kernels.fast_launch``: the key is at least as fine as Triton's specialization, a key met
before launches through the compiled launcher with every argument in parameter order, and
anything else goes through ``kernel[grid]``. On CPU the launcher is a fake (the interpreter
has none); the GPU suite runs every kernel through the real one."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

import kernels.fast_launch as fl


class _Param:
    def __init__(self, name: str, constexpr: bool) -> None:
        self.name, self.is_constexpr = name, constexpr


class _Compiled:
    packed_metadata = "meta"
    function = "fn"

    def __init__(self, owner) -> None:
        self.owner = owner

    def run(self, *call):
        self.owner.direct.append(call)
        if self.owner.direct_error is not None:
            raise self.owner.direct_error


class FakeKernel:
    """A JIT kernel with params (p, n, BLOCK: constexpr); records both launch paths."""

    def __init__(self) -> None:
        self.params = [_Param("p", False), _Param("n", False), _Param("BLOCK", True)]
        self.jit, self.direct = [], []
        self.direct_error = None
        self.jit_error = None

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            if self.jit_error is not None:
                raise self.jit_error
            self.jit.append((grid, args, kwargs))
            return _Compiled(self)

        return call


@pytest.fixture
def gpu_like(monkeypatch):
    """Direct launches allowed, on a fake device and stream."""
    monkeypatch.setattr(fl, "direct_launch_possible", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    fl._plans.clear()
    yield
    fl._plans.clear()


def test_a_key_met_before_launches_directly_with_every_argument_in_order(gpu_like):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (3,), t, 7, BLOCK=32, num_warps=4)
    assert len(k.jit) == 1 and not k.direct
    fl.launch(k, (5,), t, 39, BLOCK=32, num_warps=4)  # 7 and 39: i32, not multiples of 16
    assert len(k.jit) == 1
    (call,) = k.direct
    assert call[:9] == (5, 1, 1, 1234, "fn", "meta", None, None, None)
    assert call[9] is t and call[10:] == (39, 32)


@pytest.mark.parametrize("change", [
    lambda t: dict(args=(t[1:], 7)),  # fp32 view 4 bytes in: not 16-aligned
    lambda t: dict(args=(t.half(), 7)),  # another dtype
    lambda t: dict(args=(t, 16)),  # a multiple of 16
    lambda t: dict(args=(t, 1)),  # 1 is a constant to Triton
    lambda t: dict(args=(t, 2**31)),  # i64
    lambda t: dict(args=(t, 7), BLOCK=64),  # another constexpr
    lambda t: dict(args=(t, 7), num_warps=8),  # another option
    lambda t: dict(args=(t, 7.0)),  # a float
    lambda t: dict(args=(t, None)),  # None
])
def test_any_change_triton_specializes_on_goes_through_the_jit(gpu_like, change):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (1,), t, 7, BLOCK=32, num_warps=4)
    kw = dict(BLOCK=32, num_warps=4)
    c = change(t)
    args = c.pop("args")
    kw.update(c)
    fl.launch(k, (1,), *args, **kw)
    assert len(k.jit) == 2 and not k.direct


def test_a_parameter_left_to_its_default_always_goes_through_the_jit(gpu_like):
    k, t = FakeKernel(), torch.randn(64)
    for _ in range(3):
        fl.launch(k, (1,), t, 7, num_warps=4)  # BLOCK not passed
    assert len(k.jit) == 3 and not k.direct


def test_a_failing_direct_launch_is_retried_by_the_jit_and_not_tried_again(gpu_like):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (1,), t, 7, BLOCK=32)
    k.direct_error = TypeError("launcher signature differs")
    fl.launch(k, (1,), t, 7, BLOCK=32)
    assert len(k.direct) == 1 and len(k.jit) == 2
    fl.launch(k, (1,), t, 7, BLOCK=32)
    assert len(k.direct) == 1 and len(k.jit) == 3  # broken: the JIT from now on


def test_bad_input_gets_tritons_own_error_and_keeps_direct_launches(gpu_like):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (1,), t, 7, BLOCK=32)
    k.direct_error = ValueError("Pointer argument (at 0) cannot be accessed from Triton")
    k.jit_error = ValueError("Pointer argument (at 0) cannot be accessed from Triton")
    with pytest.raises(ValueError, match="cannot be accessed"):
        fl.launch(k, (1,), t, 7, BLOCK=32)
    k.direct_error = k.jit_error = None
    fl.launch(k, (1,), t, 7, BLOCK=32)
    assert len(k.direct) == 2 and len(k.jit) == 1


def test_without_direct_launches_every_call_goes_through_the_jit(monkeypatch):
    monkeypatch.setattr(fl, "ENABLED", False)
    assert not fl.direct_launch_possible()
    k, t = FakeKernel(), torch.randn(64)
    for _ in range(2):
        fl.launch(k, (1,), t, 7, BLOCK=32)
    assert len(k.jit) == 2 and not k.direct


def test_launch_hooks_send_launches_through_the_jit(monkeypatch):
    if fl._RUNTIME is None:
        pytest.skip("this Triton has no knobs: direct launches are off anyway")
    monkeypatch.setattr(fl.config, "interpreted", lambda: False)
    monkeypatch.setattr(fl, "ENABLED", True)
    assert fl.direct_launch_possible()  # Triton's default: no hook (None or an empty chain)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(fl._RUNTIME, name)
        if hasattr(hook, "add"):  # a HookChain
            monkeypatch.setattr(hook, "calls", [lambda *a: None])
        else:
            monkeypatch.setattr(fl._RUNTIME, name, lambda *a: None)
        assert not fl.direct_launch_possible()
        monkeypatch.undo()
        monkeypatch.setattr(fl.config, "interpreted", lambda: False)
        monkeypatch.setattr(fl, "ENABLED", True)
    assert fl.direct_launch_possible()


def test_a_bound_launch_changes_only_its_dynamic_tensors(gpu_like):
    k, t, u = FakeKernel(), torch.randn(64), torch.randn(64)
    assert fl.bind(k, (2,), (0,), t, 7, BLOCK=32) is None  # no launcher met yet
    fl.launch(k, (2,), t, 7, BLOCK=32)
    bound = fl.bind(k, (2,), (0,), t, 7, BLOCK=32)
    assert bound is not None and len(k.jit) == 1
    bound(u)
    (call,) = k.direct
    assert call[:9] == (2, 1, 1, 1234, "fn", "meta", None, None, None)
    assert call[9] is u and call[10:] == (7, 32)
    assert fl.bind(k, (2,), (1,), t, 7, BLOCK=32) is None  # only tensors may change


@pytest.mark.parametrize("other", [
    lambda t: t[1:],  # fp32 view 4 bytes in: not 16-aligned
    lambda t: t.half(),  # another dtype
])
def test_a_bound_launch_given_another_specialization_goes_through_launch(gpu_like, other):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (1,), t, 7, BLOCK=32)
    bound = fl.bind(k, (1,), (0,), t, 7, BLOCK=32)
    u = other(t)
    bound(u)
    assert len(k.jit) == 2 and not k.direct and k.jit[-1][1][0] is u  # a key of its own
    bound(u)  # launch() has met that key now: direct, with u
    assert len(k.direct) == 1 and k.direct[0][9] is u


def test_a_bound_launch_follows_hooks_and_broken_launchers(gpu_like, monkeypatch):
    k, t = FakeKernel(), torch.randn(64)
    fl.launch(k, (1,), t, 7, BLOCK=32)
    bound = fl.bind(k, (1,), (0,), t, 7, BLOCK=32)
    monkeypatch.setattr(fl, "direct_launch_possible", lambda: False)  # a profiler's hooks
    bound(t)
    assert len(k.jit) == 2 and not k.direct
    monkeypatch.setattr(fl, "direct_launch_possible", lambda: True)
    k.direct_error = TypeError("launcher signature differs")
    bound(t)
    assert len(k.direct) == 1 and len(k.jit) == 3  # retried by the JIT, marked broken
    bound(t)
    fl.launch(k, (1,), t, 7, BLOCK=32)
    assert len(k.direct) == 1 and len(k.jit) == 5


def test_the_one_launch_term_binds_at_a_signatures_second_launch(monkeypatch):
    """A signature met once (a batch that changes every step) is not bound: binding costs a
    key; from its second launch it is (here the spy's None keeps every call on the op)."""
    import kernels.shrink_expand as se
    from kernels import LoRAWeights, SegmentLayout, plan_segments

    binds = []
    monkeypatch.setattr(se, "bind", lambda *a, **k: binds.append(a[2]))
    monkeypatch.setattr(se, "direct_launch_possible", lambda: True)  # as on a GPU
    # The interpreter's device on CPU, a GPU's where there is one (Triton compiled for a GPU
    # refuses CPU tensors).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = LoRAWeights.for_linear(2, 32, (16,), 4, torch.float32, dev)
    w.ranks[:2] = 4
    x, y = torch.randn(3, 32, device=dev), torch.zeros(3, 16, device=dev)
    for slots, calls in (([0, 1, 0], 3), ([1, 1, 0], 2)):  # the second: a new signature
        binds.clear()
        layout = SegmentLayout.from_plan(plan_segments(slots, block_m=16), dev)
        for n in range(calls):
            assert len(binds) == max(0, n - 1)
            se.lora_shrink_expand(x, w, y, layout)
        assert binds == [(0, 3)] * (calls - 1)  # x and y: the tensors that change


def _pool(rng: random.Random) -> list:
    base = torch.empty(256, dtype=torch.float32)
    half = torch.empty(256, dtype=torch.float16)
    out = [base[rng.randrange(8):], half[rng.randrange(16):], torch.nn.Parameter(base[:8]),
           True, False, None, 0.5, 2.0]
    for _ in range(30):
        e = rng.choice([4, 8, 31, 32, 62, 63, 64])
        out.append(rng.choice([1, -1]) * rng.randrange(2**e) + rng.choice([0, 1]))
    out += [1, 0, 16, 2**31 - 16, 2**31, -(2**31), -(2**31) - 16, 2**63, 2**64 - 16]
    return out


def test_equal_keys_mean_equal_triton_specializations():
    """The invariant, against this Triton's own specializer, over random arguments."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    rng = random.Random(0)
    by_key: dict = {}
    for _ in range(20):
        for a in _pool(rng):
            try:
                got = tuple(native(BaseBackend, a, False, True, True))
            except OverflowError:  # outside i64 and u64: Triton refuses it at any launch
                continue
            assert by_key.setdefault(fl._spec(a), got) == got, (a, fl._spec(a))
    assert len(by_key) >= 10


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@pytest.mark.gpu
def test_real_launches_follow_alignment_and_sizes_on_the_gpu():
    """On a GPU: a kernel compiled for 16-byte-aligned pointers (vector loads) is never
    reused for a misaligned view, nor one for n = 1 for another n; every result is exact."""
    fl._plans.clear()
    buf = torch.randn(4096 + 8, device="cuda", dtype=torch.float16)
    cases = [(buf[:4096], 4096), (buf[:4096], 4096), (buf[1:4097], 4096), (buf[1:4097], 4096),
             (buf[8:4104], 4096), (buf[3:4], 1), (buf[3:4], 1), (buf[5:3005], 3000)]
    for src, n in cases:
        dst = torch.full_like(src, float("nan"))
        fl.launch(_copy_kernel, (triton.cdiv(n, 1024),), src, dst, n, BLOCK=1024, num_warps=4)
        torch.testing.assert_close(dst, src, rtol=0, atol=0)
    # keys: aligned n=4096 (twice: the second direct), misaligned, n=1, n=3000 (i32, not /16)
    assert fl.direct_launch_possible(), "no hooks, not interpreted: launches must go direct"
    assert len(fl._plans[_copy_kernel].launchers) == 4


@pytest.mark.gpu
def test_the_one_launch_lora_term_through_its_bound_launch_on_the_gpu():
    """``lora_shrink_expand`` binds its launch at the second call of a signature; later
    calls with new x and y (one of them a misaligned view) add the same term as the
    reference."""
    from kernels import LoRAWeights, SegmentLayout, plan_segments
    from kernels.reference import expand_reference, shrink_reference
    from kernels.shrink_expand import lora_shrink_expand

    g = torch.Generator(device="cuda").manual_seed(0)
    w = LoRAWeights.for_linear(3, 256, (128, 64), 16, torch.float16, "cuda")
    w.lora_a.normal_(generator=g).mul_(256**-0.5)
    w.lora_b.normal_(generator=g)
    w.ranks[:3] = torch.tensor([[16, 8], [8, 16], [4, 2]], dtype=w.ranks.dtype)
    w.scalings[:3] = 0.5
    layout = SegmentLayout.from_plan(plan_segments([0, 2, 1, 0, 2], block_m=16), "cuda")
    buf = torch.randn(5 * 192 + 8, device="cuda", dtype=torch.float16, generator=g)
    for i, off in enumerate((0, 0, 8, 8, 1)):  # a misaligned y after the binding
        x = torch.randn(5, 256, device="cuda", dtype=torch.float16, generator=g)
        y = buf[off:off + 5 * 192].view(5, 192)
        want = y.clone()
        expand_reference(shrink_reference(x, w, layout), w, want, layout)
        lora_shrink_expand(x, w, y, layout)
        torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)
        bound = w.one_launch_checked[2].bound
        assert (bound is None) == (i == 0 or not fl.direct_launch_possible())  # from the 2nd
