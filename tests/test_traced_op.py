"""Launchers are custom ops inside a trace (the CPU graph stand-in records one node per
launch) and plain calls outside one (no dispatcher on the eager path)."""

from __future__ import annotations

import torch
from conftest import DEVICE
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.silu_mul import _silu_mul_op, silu_mul
from kernels.traced_op import tracing


def test_a_trace_records_the_launch_as_one_custom_op_node():
    x = torch.randn(3, 8, device=DEVICE)
    seen = []

    def fn():
        seen.append(tracing())
        return silu_mul(x)

    gm = make_fx(fn)()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert seen == [True] and targets == ["multilora.silu_mul.default"], targets
    torch.testing.assert_close(gm(), silu_mul(x))


class _Seen(TorchDispatchMode):
    """Records the ops the dispatcher hands to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_outside_a_trace_the_launcher_skips_the_dispatcher():
    assert not tracing()
    x = torch.randn(2, 4, device=DEVICE)
    with _Seen() as seen:
        out = silu_mul(x)
    assert out.shape == (2, 2)
    assert not any("multilora" in op for op in seen.ops), seen.ops  # no custom-op dispatch
    with _Seen() as seen:
        _silu_mul_op.op(x)  # the op itself does dispatch: the check can see one
    assert any("multilora.silu_mul" in op for op in seen.ops), seen.ops
