"""The fault registry (``tests/mutants.py``) stays runnable as the code moves: every fault
still finds the code it mutates, exactly once, and every test it names still exists. A
renamed test or a reworded line otherwise surfaces only when someone runs the mutants (the
K-tail fault named a test renamed two sessions before a full run found it)."""

from __future__ import annotations

import os
import subprocess
import sys

from mutants import MUTANTS, ROOT, TESTS


def test_every_fault_finds_the_code_it_mutates_exactly_once():
    for m in MUTANTS:
        text = (ROOT / m.path).read_text()
        for old, new in m.edits:
            assert text.count(old) == 1, f"{m.name}: found {text.count(old)} times in {m.path}"
            text = text.replace(old, new)


def test_fault_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


def test_every_test_a_fault_names_exists():
    ids = sorted({*TESTS, *(t for m in MUTANTS for t in m.tests)})
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *ids], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
