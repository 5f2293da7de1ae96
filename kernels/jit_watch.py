"""Counting Triton JIT compiles, so a step that compiled a kernel shows as such.

A Triton kernel compiles once per variant: per value of its ``constexpr`` arguments and per
divisibility class of its integer and pointer arguments. A variant first met while serving
stalls that step (on an H200: 0.3 s for a LoRA kernel, 0.9-1.3 s for extend attention; under
data parallelism every rank waits at the next collective). ``Engine.warm_up`` compiles the
variants a server meets before serving; the engine records each step's compiles in its
timeline, and the benchmarks report those of their timed passes.

Hazard: this wraps ``JITFunction._do_compile``, a private method of Triton (present in 3.4 to
3.9). Where it is missing, or in the interpreter (no compiles), ``count()`` returns None.
"""

from __future__ import annotations

import functools

from kernels import config

_state = {"count": 0, "installed": False, "names": []}


def install() -> bool:
    """Starts counting (idempotent); False where compiles cannot be observed."""
    if _state["installed"]:
        return True
    if config.interpreted():
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return False

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        kernel = original(self, *args, **kwargs)
        _state["count"] += 1
        constexprs = args[3] if len(args) > 3 else kwargs.get("constexprs", {})
        values = constexprs.values() if hasattr(constexprs, "values") else ()
        _state["names"].append(f"{getattr(self, '__name__', '?')}{tuple(values)}")
        return kernel

    JITFunction._do_compile = counted
    _state["installed"] = True
    return True


def count() -> int | None:
    """Kernel variants compiled (or loaded from Triton's disk cache) since ``install``; None
    when not observable."""
    return _state["count"] if install() else None


def names_since(start: int) -> list[str]:
    """The kernels compiled since ``count()`` returned ``start``, each with its constexpr
    values (which variant it was)."""
    return list(_state["names"][start:])
