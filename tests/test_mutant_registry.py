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
    """Each named test matches a collected node exactly (a parametrized id) or by its function.
    One collection of the files: pytest given a function and a stale parametrized id of it
    collects both without complaint (the DP faults' ids went stale that way)."""
    ids = sorted({*TESTS, *(t for m in MUTANTS for t in m.tests)})
    files = sorted({i.split("::")[0] for i in ids})
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    nodes = {line.strip() for line in p.stdout.splitlines() if "::" in line}
    missing = [i for i in ids if "::" in i and i not in nodes
               and not any(n.startswith(i + "[") for n in nodes)]
    assert not missing, f"tests the registry names that do not exist: {missing}"
