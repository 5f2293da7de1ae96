"""``kernels.launch``: which calls take the direct path, and what the launcher receives.

A fake kernel stands in for a ``JITFunction`` (the interpreter has no compiled kernels): its
``[grid]`` call records a "compile" and returns a compiled kernel whose ``run`` records the
direct launches. Every argument change Triton specialises on must miss the cache."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import launch as launch_mod
from kernels.launch import launch

REAL_HOOKS_SET = launch_mod._hooks_set  # the fixture replaces it


class FakeParam:
    def __init__(self, name, constexpr=False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class FakeCompiled:
    def __init__(self, log, protocol=True):
        self.log = log
        if protocol:
            self.function, self.packed_metadata = "fn-handle", "packed"

    def run(self, *call):
        self.log.append(("direct", call))


class FakeKernel:
    def __init__(self, protocol=True):
        self.params = [FakeParam("x"), FakeParam("y"), FakeParam("n"),
                       FakeParam("BLOCK", constexpr=True), FakeParam("FLAG", True, default=7)]
        self.log, self.protocol = [], protocol

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("jit", grid, args, tuple(sorted(kwargs.items()))))
            if not self.protocol:
                return object()
            return FakeCompiled(self.log)
        return call


@pytest.fixture(autouse=True)
def direct_path(monkeypatch):
    """As on a GPU: not interpreted, device 0, a known stream, no launch hooks."""
    monkeypatch.setattr(launch_mod, "interpreted", lambda: False)
    monkeypatch.setattr(launch_mod, "ENABLED", True)
    monkeypatch.setattr(launch_mod, "_hooks_set", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234 + d, raising=False)
    launch_mod._plans.clear()
    yield
    launch_mod._plans.clear()


def _kinds(kernel):
    return [e[0] for e in kernel.log]


def test_second_call_goes_direct_with_every_argument_in_signature_order():
    k = FakeKernel()
    x, y = torch.randn(8), torch.randn(8)
    for _ in range(3):
        launch(k, (4, 2), x, y, 96, BLOCK=32, num_warps=4)
    assert _kinds(k) == ["jit", "direct", "direct"]
    assert k.log[0] == ("jit", (4, 2), (x, y, 96), (("BLOCK", 32), ("num_warps", 4)))
    call = k.log[1][1]
    # grid padded to three, the current stream, handle, metadata, no launch metadata or hooks
    assert call[:9] == (4, 2, 1, 1234, "fn-handle", "packed", None, None, None)
    # then x, y, n, BLOCK and FLAG's default: options (num_warps) are not arguments
    assert call[9:11] == (x, y) and call[11:] == (96, 32, 7)


@pytest.mark.parametrize("change", [
    "misaligned tensor", "dtype", "int equal to one", "int not divisible by 16",
    "int beyond 32 bits", "constexpr value", "launch option", "defaulted constexpr", "device",
])
def test_every_specialisation_change_misses(change, monkeypatch):
    k = FakeKernel()
    x, y = torch.randn(16), torch.randn(16)
    n = 97 if change == "int equal to one" else 96  # only the one property differs
    base = dict(args=(x, y, n), kwargs=dict(BLOCK=32, num_warps=4))
    launch(k, (1,), *base["args"], **base["kwargs"])
    launch(k, (1,), *base["args"], **base["kwargs"])
    assert _kinds(k) == ["jit", "direct"]
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "misaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = y.double()
    elif change == "int equal to one":
        args[2] = 1
    elif change == "int not divisible by 16":
        args[2] = 97
    elif change == "int beyond 32 bits":
        args[2] = 2**33  # divisible by 16, like 96
    elif change == "constexpr value":
        kwargs["BLOCK"] = 64  # divisible by 16, like 32: constexprs key by value
    elif change == "launch option":
        kwargs["num_warps"] = 8
    elif change == "defaulted constexpr":
        kwargs["FLAG"] = 8
    elif change == "device":
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch(k, (1,), *args, **kwargs)
    launch(k, (1,), *args, **kwargs)
    assert _kinds(k) == ["jit", "direct", "jit", "direct"], change


def test_launch_hooks_and_missing_protocol_and_switch_take_the_jit_path(monkeypatch):
    x = torch.randn(4)
    k = FakeKernel(protocol=False)
    for _ in range(3):
        launch(k, (1,), x, x, 16, BLOCK=16)
    assert _kinds(k) == ["jit"] * 3

    k = FakeKernel()
    monkeypatch.setattr(launch_mod, "_hooks_set", lambda: True)  # a profiler's hooks
    for _ in range(2):
        launch(k, (1,), x, x, 16, BLOCK=16)
    assert _kinds(k) == ["jit"] * 2
    monkeypatch.setattr(launch_mod, "_hooks_set", lambda: False)
    launch(k, (1,), x, x, 16, BLOCK=16)
    launch(k, (1,), x, x, 16, BLOCK=16)
    assert _kinds(k) == ["jit"] * 3 + ["direct"]  # nothing was recorded while hooked

    k = FakeKernel()
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    for _ in range(2):
        launch(k, (1,), x, x, 16, BLOCK=16)
    assert _kinds(k) == ["jit"] * 2


def test_interpreter_takes_the_jit_path(monkeypatch):
    monkeypatch.setattr(launch_mod, "interpreted", lambda: True)
    k, x = FakeKernel(), torch.randn(4)
    for _ in range(2):
        launch(k, (1,), x, x, 16, BLOCK=16)
    assert _kinds(k) == ["jit"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_direct_launches_match_the_reference_on_gpu():
    """Real kernels through both paths: aligned and misaligned views, several shapes; the
    second and later launches of a signature are direct."""
    from kernels.rms_norm import rms_norm

    launch_mod._plans.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, hidden, offset in ((3, 256, 0), (3, 256, 1), (17, 4096, 0), (17, 4096, 3)):
        for _ in range(3):
            base = torch.randn(rows * hidden + offset, device="cuda", dtype=torch.float16,
                               generator=g)
            x = base[offset:].view(rows, hidden)
            w = torch.randn(hidden, device="cuda", dtype=torch.float16, generator=g)
            got = rms_norm(x, w, 1e-6)
            x64 = x.double()
            want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    plan = next(p for k, p in launch_mod._plans.items() if "rms_norm" in str(k))
    assert len(plan.variants) >= 2  # aligned and misaligned inputs are distinct variants


def test_hooks_count_as_set_only_when_a_chain_holds_a_call(monkeypatch):
    from triton import knobs

    hooks_set = REAL_HOOKS_SET
    rt = knobs.runtime
    if not hasattr(rt, "launch_enter_hook"):
        pytest.skip("this Triton has no launch hooks")
    assert not hooks_set(), "no profiler: an empty hook chain is not a hook"
    hook = rt.launch_enter_hook
    if hasattr(hook, "add"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(rt, "launch_enter_hook", lambda *a: None)
    assert hooks_set()
