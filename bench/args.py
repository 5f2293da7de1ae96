"""Argument types and checks shared by the ``python -m bench.<tool>`` entry points. A bad value
is a one-line usage error naming its flag (argparse prints ``argument --reps: must be >= 1,
got 0`` and exits with status 2), raised at parse time, before any rank, runtime or kernel
starts: a spawned rank's traceback, or a result file that cannot be written after the whole
run, is what such inputs gave before."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def at_least(low: int):
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive = at_least(1)


def int_list(sep: str):
    """An argparse ``type``: positive integers joined by ``sep`` (``16/64``, ``1,8,64``)."""

    def parse(text: str) -> list[int]:
        return [positive(part) for part in text.split(sep)]

    parse.__name__ = f"integers >= 1 joined by {sep!r}"
    return parse


def torch_dtype(text: str) -> torch.dtype:
    """An argparse ``type``: a floating-point torch dtype's name (``float32``, ``bfloat16``,
    ``float16``)."""
    value = getattr(torch, text, None)
    if not isinstance(value, torch.dtype):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch dtype (e.g. float32, "
                                         "bfloat16, float16)")
    if not value.is_floating_point or value.itemsize < 2:  # int32: a traceback once the
        # model was being built; float8 is no dtype a model here runs in
        raise argparse.ArgumentTypeError(f"{text!r} is not a floating-point dtype a model runs "
                                         "in: give float32, bfloat16 or float16")
    return value


def torch_device(text: str) -> torch.device:
    """An argparse ``type``: a device this machine has (``cpu``, ``cuda``, ``cuda:1``)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, "
                                         "cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available; use cpu")
    return device


def check_out_file(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Before any case runs: ``path`` can be written as a file (not a folder; its folder
    exists and is writable), so a long run does not end in a traceback."""
    if path.is_dir():
        parser.error(f"{flag} {path} is a folder: give a file path (e.g. {path / 'rows.json'})")
    folder = path.parent
    if not folder.is_dir():
        parser.error(f"{flag} {path}: the folder {folder} does not exist; create it or give "
                     "another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: the folder {folder} is not writable; give a writable path")


def nonempty_path(text: str) -> Path:
    """An argparse ``type``: a path that is not empty. ``Path("")`` is the current folder:
    ``--out "$DIR"`` with ``DIR`` unset wrote a run's result files into the working
    directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (read as the current folder): give "
                                         "a path")
    return Path(text)


def existing_file(text: str) -> Path:
    """An argparse ``type``: a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path
