"""Launching a Triton kernel without ``JITFunction.run`` once it has run with the same
specialization.

``kernel[grid](*args)`` binds and specializes every argument, hashes the result, looks the
compiled kernel up, then calls its launcher. On the lent H100's host that costs 11 us for a
one-pointer kernel and 25 us for one of 11 pointers and 11 ints, of which the launcher
itself takes 5.0 and 7.5 us (``tmpdev``'s launch probe): an eager forward of few rows, which
waits on its host, pays the difference at each of its ~200 launches. ``launch`` keeps each
kernel's compiled launcher under a key of what Triton specializes on, computed here, and
calls the launcher directly when the key was met before. ``bind`` goes further for a call
site that repeats one signature: every argument fixed but a few tensors, whose dtype and
alignment alone are checked at each call.

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


def _resolve(kernel, args: tuple, kwargs: dict):
    """``(plan, full, key)`` for a direct launch of these arguments (``full``: every parameter
    in order), or None where ``kernel[grid]`` must bind them."""
    plan = _plans.get(kernel)
    if plan is None:
        plan = _plans[kernel] = _Plan(kernel)
    names = plan.names
    if plan.broken or len(args) > len(names) or len(args) + len(kwargs) < len(names):
        return None
    full = list(args)
    try:
        for name in names[len(args):]:
            full.append(kwargs[name])
    except KeyError:  # a parameter left to its default: Triton binds it
        return None
    options = tuple(kv for kv in kwargs.items() if kv[0] not in names[len(args):])
    device = torch._C._cuda_getDevice()
    # Tensors inline (the usual runtime argument): a call per argument costs ~0.5 us.
    key = (device, options, plan.constexprs(full), tuple([
        (a.dtype, a.data_ptr() & 15 == 0) if type(a) is _TENSOR else _spec(a)
        for a in plan.runtime_args(full)]))
    return plan, full, key


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled launcher when this key was
    launched before. ``kwargs``: the kernel's trailing parameters by name, then launch options.
    """
    resolved = _resolve(kernel, args, kwargs) if direct_launch_possible() else None
    if resolved is None:
        kernel[grid](*args, **kwargs)
        return
    plan, full, key = resolved
    hit = plan.launchers.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            plan.launchers[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        return
    if not _run_direct(hit, grid, key[0], full):
        kernel[grid](*args, **kwargs)  # raises Triton's own error where the input is bad
        plan.broken = True  # Triton launched it: its launcher differs from what this calls


def _run_direct(hit: tuple, grid: tuple, device: int, full: list) -> bool:
    """Launches through the compiled launcher; False where it raised (nothing launched)."""
    run, function, metadata = hit
    g0, g1, g2 = (*grid, 1, 1)[:3]
    try:
        run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), function, metadata,
            None, None, None, *full)
    except Exception:
        return False
    return True


class BoundLaunch:
    """``launch(kernel, grid, *args, **kwargs)`` with every argument fixed but the tensors at
    positions ``dynamic`` of ``args``: for a call site that launches one signature many times
    (the eager one-launch LoRA term: ``x`` and ``y`` change, the weights and the layout do
    not), which would otherwise recompute the whole key at each call (~7 us for 31 arguments
    on a slow host). A call checks what the key holds of the new tensors (dtype, 16-byte
    alignment), the current device and that direct launches are still possible; any
    difference goes through ``launch``. Invariant: the fixed arguments are what they were at
    ``bind`` (the caller binds per signature of objects it holds)."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "dynamic", "specs", "plan", "hit",
                 "device", "full")

    def __init__(self, kernel, grid, args, kwargs, dynamic, plan, hit, device, full) -> None:
        self.kernel, self.grid, self.args, self.kwargs = kernel, grid, args, kwargs
        self.dynamic, self.plan, self.hit, self.device, self.full = (
            dynamic, plan, hit, device, full)
        self.specs = tuple((args[i].dtype, args[i].data_ptr() & 15 == 0) for i in dynamic)
        for i in dynamic:  # each call brings its own: holding the first would pin its memory
            args[i] = full[i] = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        if (not self.plan.broken and direct_launch_possible()
                and torch._C._cuda_getDevice() == self.device):
            full = self.full.copy()
            for i, t, (dtype, aligned) in zip(self.dynamic, tensors, self.specs, strict=True):
                if type(t) is not _TENSOR or t.dtype != dtype or (
                        t.data_ptr() & 15 == 0) != aligned:
                    break
                full[i] = t
            else:
                if _run_direct(self.hit, self.grid, self.device, full):
                    return
                self.kernel[self.grid](*self._args(tensors), **self.kwargs)  # Triton's error
                self.plan.broken = True
                return
        launch(self.kernel, self.grid, *self._args(tensors), **self.kwargs)

    def _args(self, tensors: tuple) -> list:
        args = list(self.args)
        for i, t in zip(self.dynamic, tensors, strict=True):
            args[i] = t
        return args


def bind(kernel, grid: tuple, dynamic: tuple[int, ...], *args, **kwargs) -> BoundLaunch | None:
    """A ``BoundLaunch`` of these arguments, once ``launch`` has met their key (None before,
    and wherever ``launch`` would not launch directly)."""
    resolved = _resolve(kernel, args, kwargs) if direct_launch_possible() else None
    if resolved is None or not all(type(args[i]) is _TENSOR for i in dynamic):
        return None
    plan, full, key = resolved
    hit = plan.launchers.get(key)
    if hit is None:
        return None
    return BoundLaunch(kernel, grid, list(args), kwargs, dynamic, plan, hit, key[0], full)
