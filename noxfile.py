"""Sessions: ``tests`` (the CPU suite in CI), ``lint``, ``bench`` (the main job)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite. Without a GPU, Triton kernels run under TRITON_INTERPRET=1."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: Llama-3-8B shapes on a GPU; a small CPU profile end to end without one.
    Extra arguments go to ``python -m bench`` (see ``nox -s bench -- --help``)."""
    session.install("-e", ".")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Fault injection: each protection against stale LoRA metadata, broken one at a time,
    must make the stale-state tests fail. Prints killed/total; fails unless all are killed."""
    session.install("-e", ".[test]")
    session.run("python", "tests/mutants.py", *session.posargs)
