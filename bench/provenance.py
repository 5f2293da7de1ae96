"""What a result row needs to be reproduced: code version, software, hardware, command."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _sha() -> str:
    sha = _git("rev-parse", "--verify", "HEAD")
    if re.fullmatch(r"[0-9a-f]{40}", sha):
        return sha
    return os.environ.get("MULTILORA_GIT_SHA", "unknown")


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (CPU machine, or the library is missing): not an error here
        return ""


def collect(device: torch.device) -> dict:
    return {
        # Copies of the tree without .git (a lent GPU machine) pass the sha in the environment.
        "git_sha": _sha(),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": driver_version() if device.type == "cuda" else "",
        "host": platform.node(),
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "bench", *sys.argv[1:]]),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
