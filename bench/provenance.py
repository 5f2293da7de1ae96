"""What a result row needs to be reproduced: code version, software, hardware, command."""

from __future__ import annotations

import datetime
import os
import platform
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import triton

from bench import telemetry

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """The command's output, or None where git failed (not installed, not a repository, a
    repository git refuses as of dubious ownership): no output is not a clean tree."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _sha() -> str:
    # A copy of the tree on another machine may carry a stale .git: the environment wins.
    if os.environ.get("MULTILORA_GIT_SHA"):
        return os.environ["MULTILORA_GIT_SHA"]
    sha = _git("rev-parse", "--verify", "HEAD") or ""
    if re.fullmatch(r"[0-9a-f]{40}", sha):
        return sha
    return os.environ.get("MULTILORA_GIT_SHA", "unknown")


def _dirty() -> bool | None:
    if not (ROOT / ".git").exists():
        return None  # a copy without .git: unknown
    passed = os.environ.get("MULTILORA_GIT_SHA")
    if passed and not (_git("rev-parse", "--verify", "HEAD") or "").startswith(passed):
        return None  # a copy's stale .git: git would compare the tree with another commit
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)  # git failed: unknown, not clean


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(device: torch.device) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def collect(device: torch.device, command: list[str] | None = None) -> dict:
    """``command``: the command line that ran (default ``python -m bench`` and this process's
    arguments; a tool that calls another, as ``bench.profile`` calls ``bench``, passes it)."""
    command = command or ["python", "-m", "bench", *sys.argv[1:]]
    now = datetime.datetime.now(datetime.UTC)
    return {
        # Copies of the tree without .git (a lent GPU machine) pass the sha in the environment.
        "git_sha": _sha(),
        "git_dirty": _dirty(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
        "device": device_name(device),
        "driver": telemetry.driver_version() if device.type == "cuda" else "",
        "host": platform.node(),
        "command": " ".join(shlex.quote(a) for a in command),
        "timestamp": now.isoformat(timespec="seconds"),
        "run_id": run_id(now),
    }


def run_id(now: datetime.datetime) -> str:
    """``<UTC time to the microsecond>-<sha>-<random>``: ids of runs started in one second
    still sort by start time (the latest run wins, ``results.latest_per_case``), and two runs
    of one clock tick differ. Ids of before had ``<YYYYmmdd-HHMMSS>-<sha>``."""
    return f"{now:%Y%m%d-%H%M%S.%f}-{_sha()[:10]}-{secrets.token_hex(3)}"
