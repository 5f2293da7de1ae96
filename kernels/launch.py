"""Launching a compiled Triton kernel without ``JITFunction.run``'s per-call work.

``kernel[grid](...)`` binds and specialises every argument, hashes the specialisation, reads
the device, the stream and Triton's knobs and builds launch metadata on every call: 25-35 us
of host time a launch on the H200's host, most of an eager decode step's host time.
``launch(kernel, grid, ...)`` keys the kernel's compiled variants by a cheaper signature of
the arguments and, on a hit, calls the compiled kernel's launcher itself.

The key refines Triton's specialisation (so a hit is always the variant Triton would pick):
constexpr arguments and launch options by value; tensors by dtype and 16-byte alignment;
integers by ``== 1``, divisibility by 16 and 32/64-bit range; anything else by value. A miss
launches through ``kernel[grid]`` (compiling as usual, counted by ``jit_watch``) and records
the variant that call returned.

Hazard: the hit path uses the launcher protocol of Triton 3.4 to 3.9 (``CompiledKernel.run``
takes the grid, the stream, the function handle, the packed metadata, launch metadata, the
enter and exit hooks, then every argument in signature order). Where that protocol is not
there, while a launch hook is set (profilers), in the interpreter, or with
``MULTILORA_DIRECT_LAUNCH=0``, every call goes through ``kernel[grid]``.
"""

from __future__ import annotations

import os

import torch

from kernels.config import interpreted

ENABLED = os.environ.get("MULTILORA_DIRECT_LAUNCH", "1") != "0"
"""Read at import; ``MULTILORA_DIRECT_LAUNCH=0`` for A/B runs and as a way out."""

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(a):
    """An argument's share of the key: at least what Triton specialises it on."""
    t = type(a)
    if t is int:
        return (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX, a >= 2**63)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0, a.device)
    if t is float:
        return float
    return (t, a)


class _Plan:
    """One kernel's signature and its compiled variants by key."""

    __slots__ = ("kernel", "names", "constexpr", "defaults", "variants")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        params = kernel.params
        self.names = [p.name for p in params]
        self.constexpr = frozenset(i for i, p in enumerate(params) if p.is_constexpr)
        self.defaults = {p.name: p.default for p in params}
        self.variants: dict = {}

    def arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
        """Every argument in signature order (defaults filled in), and the launch options."""
        n = len(args)
        rest = tuple(kwargs[name] if name in kwargs else self.defaults[name]
                     for name in self.names[n:])
        options = tuple((k, v) for k, v in kwargs.items() if k not in self.defaults)
        return args + rest, options

    def key(self, full: tuple, options: tuple, device: int) -> tuple:
        const = self.constexpr
        return (device, options,
                tuple(a if i in const else _spec(a) for i, a in enumerate(full)))


_plans: dict = {}


def _direct(compiled) -> tuple | None:
    """The launcher, function handle and packed metadata of ``compiled``, or None where this
    Triton's compiled kernel does not have them."""
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    try:
        return compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None


def _hooks_set() -> bool:
    """Whether a launch hook is registered (a profiler's): Triton 3.4+ keeps them in
    ``HookChain`` objects, never None, whose ``calls`` list is empty by default."""
    from triton import knobs

    rt = knobs.runtime
    return any(h is not None and bool(getattr(h, "calls", True))
               for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, with the per-call work of Triton's launch path
    skipped once this argument signature has launched."""
    if not ENABLED or interpreted():
        kernel[grid](*args, **kwargs)
        return
    plan = _plans.get(kernel)
    if plan is None:
        plan = _plans[kernel] = _Plan(kernel)
    full, options = plan.arguments(args, kwargs)
    device = torch.cuda.current_device()
    key = plan.key(full, options, device)
    hit = plan.variants.get(key)
    if hit is None or _hooks_set():
        compiled = kernel[grid](*args, **kwargs)
        if hit is None and not _hooks_set():
            plan.variants[key] = _direct(compiled) or False
        return
    if hit is False:  # this Triton's compiled kernels lack the direct protocol
        kernel[grid](*args, **kwargs)
        return
    run, function, metadata = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), function, metadata, None,
        None, None, *full)
