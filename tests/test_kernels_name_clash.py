"""Hugging Face's `kernels` package (a dependency of transformers >= 5.25) has this project's
import name: when it comes first on the path, importing the runtime must say so, not fail later
on a missing kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_runtime(extra_path: Path | None) -> subprocess.CompletedProcess:
    paths = ([str(extra_path)] if extra_path else []) + [str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, "-c", "import lora_runtime"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120)


def test_foreign_kernels_package_is_named(tmp_path):
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("CUDAProperties = object\n")
    run = _import_runtime(tmp_path)
    assert run.returncode != 0
    assert "not this project's kernels package" in run.stderr
    assert str(foreign / "__init__.py") in run.stderr
    assert "transformers < 5.25" in run.stderr


def test_own_kernels_package_imports():
    run = _import_runtime(None)
    assert run.returncode == 0, run.stderr
