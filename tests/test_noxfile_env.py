"""The shared nox environment is recreated when TORCH_INDEX_URL names another index than the
one its torch came from (pip keeps an installed torch whatever the index, so the variable
set after a first run switched nothing), and kept otherwise. ``noxfile._python`` runs with a
fake session whose ``run`` records commands (a venv command makes the environment's files)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU = "https://download.pytorch.org/whl/cpu"


def _noxfile(monkeypatch):
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = object
    fake.session = lambda *a, **k: (lambda f: f) if not a or not callable(a[0]) else a[0]
    monkeypatch.setitem(sys.modules, "nox", fake)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeSession:
    def __init__(self):
        self.runs: list[tuple] = []

    def log(self, *_):
        pass

    def run(self, *args):
        self.runs.append(args)
        if "venv" in args:
            Path(args[-1], "bin").mkdir(parents=True)
            Path(args[-1], "bin", "python").touch()


def _serve(monkeypatch, tmp_path, index: str | None) -> FakeSession:
    nf = _noxfile(monkeypatch)
    monkeypatch.chdir(tmp_path)
    if index is None:
        monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    else:
        monkeypatch.setenv("TORCH_INDEX_URL", index)
    session = FakeSession()
    nf._python(session)
    return session


def _torch_install(session: FakeSession) -> tuple | None:
    return next((r for r in session.runs if "torch" in r), None)


@pytest.mark.parametrize("first, then, recreated", [
    (None, CPU, True), (CPU, None, True), (CPU, CPU, False), (None, None, False),
    (CPU, "https://example.org/whl/cu130", True)])
def test_the_shared_environment_follows_torch_index_url(monkeypatch, tmp_path, first, then,
                                                        recreated):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    first_run = _serve(monkeypatch, tmp_path, first)
    install = _torch_install(first_run)
    assert install[-2:] == ("--index-url", first) if first else "--index-url" not in install
    marker = tmp_path / ".nox/shared/kept"
    marker.touch()
    second = _serve(monkeypatch, tmp_path, then)
    assert (not marker.exists()) == recreated
    install = _torch_install(second)
    assert (install is not None) == recreated
    if recreated and then:
        assert install[-2:] == ("--index-url", then)


def test_an_environment_of_unknown_origin_is_kept_unless_an_index_is_asked_for(monkeypatch,
                                                                               tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    _serve(monkeypatch, tmp_path, None)
    (tmp_path / ".nox/shared/torch-index-url").unlink()  # made before the index was recorded
    assert _torch_install(_serve(monkeypatch, tmp_path, None)) is None
    assert _torch_install(_serve(monkeypatch, tmp_path, CPU))[-2:] == ("--index-url", CPU)
