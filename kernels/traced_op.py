"""Custom ops for tracers only. A launcher's Triton call must appear as one opaque node when
the CPU graph stand-in traces a forward (``make_fx``) or ``torch.compile`` does, so every
launcher is a ``torch.library`` custom op. But the dispatcher's Python path (argument
defaults, autograd and in-place bookkeeping) cost ~250 us per LoRA module on a 2-core host,
more than the launches: outside a trace the launcher's body runs directly."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_PROXY = torch._C._TorchDispatchModeKey.PROXY


def tracing() -> bool:
    return torch._C._get_dispatch_mode(_PROXY) is not None or torch.compiler.is_compiling()


def traced_op(name: str, mutates_args=()) -> Callable:
    """Like ``torch.library.custom_op(name, mutates_args=...)``; the result runs the function
    itself unless a tracer is active. ``.register_fake`` registers the op's fake kernel."""

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if tracing() else fn(*args)

        call.op = op
        call.register_fake = op.register_fake
        return call

    return wrap
