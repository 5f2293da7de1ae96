"""Compile for the GPU, on a machine without one, the Triton kernels that a CPU run launched.

The interpreter accepts code the GPU compiler rejects (a ``tl.constexpr`` passed through a
tuple, for one), so a kernel can pass every CPU test and fail at its first launch on the
device. ``recorded_launches`` runs a callable under the interpreter and records each kernel
launch's argument types and compile-time values; ``compile_for_gpu`` compiles each recorded
launch for ``GPUTarget("cuda", 90, 32)`` (the H200's architecture) in a fresh process with the
interpreter off, since a process that imported the kernels interpreted holds no JIT functions.
No device is needed: Triton's front end, its MLIR passes and ptxas all run on the host.
Arguments are specialised as the JIT does on a device (16-byte-aligned pointers and integers
divisible by 16 marked so, integers equal to 1 compiled as constants), so ``compiled_ptx``
shows the code a launch gets there: whether its memory accesses are vectors, for one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
           torch.int32: "i32", torch.int64: "i64", torch.bool: "i1", torch.int8: "i8"}


def _arg_type(value, as_dtype: dict) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[as_dtype.get(value.dtype, value.dtype)]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


@contextlib.contextmanager
def recorded_launches(as_dtype: dict | None = None):
    """Records every interpreted kernel launch inside the block: a list of dicts (module,
    name, signature, constexprs, num_warps). ``as_dtype`` maps tensor dtypes for the
    signature (e.g. fp16 -> bf16: the interpreter's dot is wrong in bf16, the GPU's is not)."""
    from triton.runtime.interpreter import InterpretedFunction

    as_dtype = as_dtype or {}
    launches: list[dict] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = list(self.arg_names)
        values = dict(zip(params, args, strict=False)) | {
            k: v for k, v in kwargs.items() if k in params}
        # The JIT compiles an integer argument equal to 1 as that constant (a unit stride).
        constexprs = {p: values[p] for p in params
                      if _is_constexpr(fn, p) or _is_one(values[p])}
        signature = {p: "constexpr" if p in constexprs else _arg_type(values[p], as_dtype)
                     for p in params}
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        launches.append(dict(module=fn.__module__, name=fn.__name__, signature=signature,
                             constexprs=constexprs, options=options,
                             divisible=[p for p in params if p not in constexprs
                                        and _divisible_by_16(values[p])]))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def _is_one(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 1


def _divisible_by_16(value) -> bool:
    """What the JIT marks ``tt.divisibility = 16``: a tensor whose address is 16-byte aligned,
    an integer that is a multiple of 16."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _is_constexpr(fn, param: str) -> bool:
    ann = fn.__annotations__.get(param)
    return ann is not None and "constexpr" in str(ann)


_COMPILE = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failures, ptx = [], []
for launch in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = kernel.arg_names
    consts = {(names.index(k),): v for k, v in launch["constexprs"].items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in launch.get("divisible", ())}
    src = ASTSource(fn=kernel, signature=launch["signature"], constexprs=consts, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=launch["options"])
        ptx.append(compiled.asm["ptx"])
    except Exception as e:  # noqa: BLE001  (reported, not raised: every launch is tried)
        failures.append(f"{launch['module']}.{launch['name']}: {type(e).__name__}: {e}")
        ptx.append(None)
print(json.dumps({"failures": failures, "ptx": ptx}))
"""


def gpu_compiler_available() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


def _compile(launches: list[dict], timeout: float, extra_path: str | None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), extra_path) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(launches),
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the compile process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_for_gpu(launches: list[dict], timeout: float = 600,
                    extra_path: str | None = None) -> list[str]:
    """Compiles each distinct recorded launch for sm_90; returns the failures' messages.
    ``extra_path``: a folder the kernels' modules are imported from besides the project."""
    unique = {json.dumps(launch, sort_keys=True): launch for launch in launches}
    return _compile(list(unique.values()), timeout, extra_path)["failures"]


def compiled_ptx(launches: list[dict], timeout: float = 600) -> list[str]:
    """The sm_90 PTX of each recorded launch, in order (a launch that fails to compile
    raises)."""
    out = _compile(launches, timeout, None)
    if out["failures"]:
        raise RuntimeError("\n".join(out["failures"]))
    return out["ptx"]
