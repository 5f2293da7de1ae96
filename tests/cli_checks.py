"""Checks shared by the tests of the bench tools' argument refusals."""

from __future__ import annotations

import pytest


def never(*args, **kwargs):
    raise AssertionError("the tool started its work before refusing its arguments")


def usage_error(capsys, fn, argv, says: str) -> None:
    """``fn(argv)`` exits with argparse's usage status, its message saying ``says``."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2, e.value.code
    err = capsys.readouterr().err
    assert says in err, err
