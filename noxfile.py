"""Sessions: ``tests`` (the CPU suite in CI), ``lint``, ``bench`` (the main job), ``report``,
``profile``, ``mutants``, ``hostbench``.

Every session but ``lint`` runs in one shared environment, ``.nox/shared``, created on first
use and reinstalled only when ``pyproject.toml`` changes (torch is large: one copy, not one
per session). ``TORCH_INDEX_URL`` installs torch from that index first, e.g. the CPU-only
build: ``TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu nox -s tests``; a value other
than the one the environment was made with recreates it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"

SHARED = Path(".nox/shared")


def _python(session: nox.Session) -> str:
    """The shared environment's interpreter, created and installed when needed."""
    py = SHARED / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    stamp = SHARED / "installed-from.sha256"
    want = hashlib.sha256(Path("pyproject.toml").read_bytes()).hexdigest()
    index = os.environ.get("TORCH_INDEX_URL", "")
    if py.exists() and _index_changed(_torch_index(SHARED), index):
        # pip keeps an installed torch whatever the index: only a new environment switches.
        came = _torch_index(SHARED) or "(unset or unknown)"
        session.log(f"TORCH_INDEX_URL is now {index or '(unset)'!r}, the shared environment's "
                    f"torch came from {came!r}: recreating it")
        shutil.rmtree(SHARED)
    if not py.exists() and SHARED.exists():
        # Its interpreter is gone (a dangling link: that Python removed or upgraded). A venv
        # made over the folder keeps the link, and the stamp would skip the install.
        session.log(f"the shared environment's interpreter {py} is missing: recreating it")
        shutil.rmtree(SHARED)
    if not py.exists():
        session.log(f"creating the shared environment {SHARED}")
        session.run(sys.executable, "-m", "venv", str(SHARED))
        session.run(str(py), "-m", "pip", "install", "--upgrade", "pip")
    if not stamp.exists() or stamp.read_text() != want:
        (SHARED / "torch-index-url").write_text(index)
        # torch first, so that its own triton pin picks triton: resolving the project's
        # `triton>=3.1` first fetched the newest triton (3.9.0, 286 MB) before pip read
        # torch's `triton~=3.8.0`, which then rejected it.
        session.run(str(py), "-m", "pip", "install", "--progress-bar", "on", "torch",
                    *(["--index-url", index] if index else []))
        session.log("installing torch, triton and the test tools (first run: a few GB "
                    "with a CUDA build of torch, a few hundred MB with a CPU build)")
        session.run(str(py), "-m", "pip", "install", "--progress-bar", "on", "-e", ".[test]")
        stamp.write_text(want)
    return str(py)


def _torch_index(env: Path) -> str | None:
    """The TORCH_INDEX_URL ``env``'s torch was installed from ("": PyPI; None: not recorded,
    an environment made before it was)."""
    f = env / "torch-index-url"
    return f.read_text() if f.exists() else None


def _index_changed(recorded: str | None, wanted: str) -> bool:
    """An environment of unknown origin is kept unless an index is asked for."""
    return recorded != wanted if recorded is not None else wanted != ""


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite. Without a GPU, Triton kernels run under TRITON_INTERPRET=1."""
    session.run(_python(session), "-m", "pytest", *(session.posargs or ["-q", "--durations=12"]))


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: Llama-3-8B shapes on a GPU; a small CPU profile end to end without one.
    Writes results and report.html into a new run folder under results/runs/ and prints it.
    Extra arguments go to ``python -m bench`` (see ``nox -s bench -- --help``)."""
    session.run(_python(session), "-m", "bench", *session.posargs)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """HTML report of result files or run folders (default: the newest run folder holding
    result files; other JSON in a folder, e.g. a profile run's trace, is skipped).
    ``nox -s report -- results/runs/<run> --baseline results/kernels-nvidia-h200.json``."""
    session.run(_python(session), "-m", "bench.report", *session.posargs)


@nox.session(venv_backend="none")
def profile(session: nox.Session) -> None:
    """One case under nsys (or the torch profiler when nsys is missing):
    ``nox -s profile -- 'kernels gate_up_proj T=2048 adapters=1 r=64'``."""
    if not session.posargs:
        session.error("give a case filter: nox -s profile -- '<label regex>' "
                      "(labels: nox -s bench -- --list)")
    session.run(_python(session), "-m", "bench.profile", *session.posargs)


@nox.session(venv_backend="none")
def mutants(session: nox.Session) -> None:
    """Fault injection: each protection against stale LoRA metadata, broken one at a time,
    must make the stale-state tests fail. Prints killed/total; fails unless all are killed."""
    session.run(_python(session), "tests/mutants.py", *session.posargs)


@nox.session(venv_backend="none")
def hostbench(session: nox.Session) -> None:
    """Host-path benchmarks (pytest-benchmark): saves the run under results/runs/host/ and
    compares it with the previous run of this device, failing past ``--threshold`` (1.5x the
    median). ``nox -s hostbench -- --baseline results/host-cpu.json -k plan``; ``--publish``
    writes the committed reference (a run of every benchmark only: not with ``-k``). See
    ``python -m bench.host --help``."""
    session.run(_python(session), "-m", "bench.host", *session.posargs)
