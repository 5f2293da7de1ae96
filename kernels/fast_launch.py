"""Launching a Triton kernel without ``JITFunction.run`` once it has run with the same
specialization.

``kernel[grid](*args)`` binds and specializes every argument, hashes the result, looks the
compiled kernel up, then calls its launcher. On the lent H100's host that costs 11 us for a
one-pointer kernel and 25 us for one of 11 pointers and 11 ints, of which the launcher
itself takes 5.0 and 7.5 us (``tmpdev``'s launch probe): an eager forward of few rows, which
waits on its host, pays the difference at each of its ~200 launches. ``launch`` keeps each
kernel's compiled launcher under a key of what Triton specializes on, computed here, and
calls the launcher directly when the key was met before.

Invariant: the key is at least as fine as Triton's own: every ``constexpr`` by value; a
tensor by dtype and whether its address is a multiple of 16; an int by whether it is 1, a
multiple of 16, and its integer type (i32, i64, u64); a bool, a float, None by kind. Two
calls with one key therefore get the same compiled kernel from Triton; a key met the first
time goes through ``kernel[grid]`` (which compiles or finds it) and is stored.

Hazards: this relies on ``CompiledKernel.run``'s argument order (grid, stream, function,
packed metadata, launch metadata, hooks, arguments), the same in Triton 3.4 to 3.9; a launch
that fails there is retried through ``kernel[grid]``, and the kernel is not launched directly
again. Launch hooks (a profiler's) or the interpreter send every launch through
``kernel[grid]``; so does ``MULTILORA_FAST_LAUNCH=0``. Options a call passes (``num_warps``,
``num_stages``, ``launch_pdl``) are part of the key.
"""

from __future__ import annotations

import os
from operator import itemgetter

import torch

from kernels import config

ENABLED = os.environ.get("MULTILORA_FAST_LAUNCH", "1") != "0"

try:
    from triton import knobs as _knobs

    _RUNTIME = _knobs.runtime
except ImportError:  # Triton before 3.4: no direct launches
    _RUNTIME = None

_TENSOR = torch.Tensor
_I32 = (-(2**31), 2**31)


def _picker(indices: list[int]):
    """A function returning the tuple of a sequence's items at ``indices`` (in C)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return itemgetter(*indices) if indices else (lambda seq: ())


class _Plan:
    """One kernel's parameters (names, which are constexpr) and its launchers by key."""

    __slots__ = ("names", "constexprs", "runtime_args", "launchers", "broken")

    def __init__(self, kernel) -> None:
        params = kernel.params
        self.names = tuple(p.name for p in params)
        flags = [bool(p.is_constexpr) for p in params]
        self.constexprs = _picker([i for i, c in enumerate(flags) if c])
        self.runtime_args = _picker([i for i, c in enumerate(flags) if not c])
        self.launchers: dict = {}
        self.broken = False


_plans: dict = {}


def _spec(value):
    """What Triton specializes a non-constexpr argument on (see the module's invariant)."""
    kind = type(value)
    if kind is _TENSOR:
        return (value.dtype, value.data_ptr() & 15 == 0)
    if kind is int:
        if value == 1:
            return 1
        if _I32[0] <= value < _I32[1]:
            return ("i32", value & 15 == 0)
        return ("u64" if value >= 2**63 else "i64", value & 15 == 0)
    if isinstance(value, _TENSOR):  # a Parameter, a subclass
        return (value.dtype, value.data_ptr() & 15 == 0)
    if kind is float or kind is bool or value is None:
        return kind
    return (kind, value)  # anything else by value: an unknown kind never shares a key


def _no_hook(hook) -> bool:
    """None, or an empty ``HookChain`` (Triton 3.5+: a chain with nothing added)."""
    return hook is None or getattr(hook, "calls", None) == []


def direct_launch_possible() -> bool:
    """Whether ``launch`` may call compiled launchers directly now (not interpreted, not
    disabled, no launch hooks installed)."""
    return (ENABLED and _RUNTIME is not None and not config.interpreted()
            and _no_hook(_RUNTIME.launch_enter_hook) and _no_hook(_RUNTIME.launch_exit_hook))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled launcher when this key was
    launched before. ``kwargs``: the kernel's trailing parameters by name, then launch options.
    """
    if not direct_launch_possible():
        kernel[grid](*args, **kwargs)
        return
    plan = _plans.get(kernel)
    if plan is None:
        plan = _plans[kernel] = _Plan(kernel)
    names = plan.names
    if plan.broken or len(args) > len(names) or len(args) + len(kwargs) < len(names):
        kernel[grid](*args, **kwargs)
        return
    full = list(args)
    try:
        for name in names[len(args):]:
            full.append(kwargs[name])
    except KeyError:  # a parameter left to its default: Triton binds it
        kernel[grid](*args, **kwargs)
        return
    options = tuple(kv for kv in kwargs.items() if kv[0] not in names[len(args):])
    device = torch._C._cuda_getDevice()
    # Tensors inline (the usual runtime argument): a call per argument costs ~0.5 us.
    key = (device, options, plan.constexprs(full), tuple([
        (a.dtype, a.data_ptr() & 15 == 0) if type(a) is _TENSOR else _spec(a)
        for a in plan.runtime_args(full)]))
    hit = plan.launchers.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            plan.launchers[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        return
    run, function, metadata = hit
    g0, g1, g2 = (*grid, 1, 1)[:3]
    try:
        run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), function, metadata,
            None, None, None, *full)
    except Exception:
        kernel[grid](*args, **kwargs)  # raises Triton's own error where the input is bad
        plan.broken = True  # Triton launched it: its launcher differs from what this calls
