"""``--profile cpu`` on a machine with a GPU: Triton compiled the CPU profile's kernels for the
GPU ("Pointer argument cannot be accessed from Triton (cpu tensor?)") and its DP ranks took
NCCL, one GPU a rank (seen on the H200: three suites failed). The entry points now hide the
GPUs and turn the interpreter on before torch or Triton look; an in-process call that cannot
do that is refused naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import cli
from bench.cpu_only import cpu_profile_requested

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, cpu", [
    (["--profile", "cpu"], True),
    (["--profile=cpu", "--suite", "kernels"], True),
    (["--prof", "cpu"], True),
    (["--filter", "cpu", "--profile", "gpu-quick"], False),
    (["--profile", "gpu"], False),
    ([], False),
    (["--profile"], False),  # the real parser names the missing value
])
def test_the_cpu_profile_is_recognised_as_python_m_bench_reads_it(argv, cpu):
    assert cpu_profile_requested(argv) is cpu


RUN = """
import os, runpy, sys
sys.argv = ["bench", *sys.argv[1:]]
try:
    runpy.run_module("{module}", run_name="__main__")
except SystemExit:
    pass
print(repr(os.environ.get("CUDA_VISIBLE_DEVICES")), repr(os.environ.get("TRITON_INTERPRET")))
"""


@pytest.mark.parametrize("module", ["bench", "bench.profile"])
@pytest.mark.parametrize("profile, hidden", [("cpu", True), ("gpu-quick", False)])
def test_the_entry_points_hide_the_gpus_for_the_cpu_profile_only(module, profile, hidden):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    args = ["--list", "--suite", "kernels"] if module == "bench" else ["no such case"]
    p = subprocess.run([sys.executable, "-c", RUN.format(module=module), "--profile", profile,
                        *args], cwd=ROOT, env=env | {"PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)
    gpus, interpret = p.stdout.strip().splitlines()[-1].split()
    if hidden:
        assert (gpus, interpret) == ("''", "'1'"), p.stdout + p.stderr
    else:
        assert gpus == "None", p.stdout + p.stderr


def test_an_in_process_cpu_run_beside_a_gpu_without_the_interpreter_is_refused(
        monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "interpreted", lambda: False)
    with pytest.raises(SystemExit, match=r"runs on the CPU.*python -m bench --profile cpu.*"
                                         r"CUDA_VISIBLE_DEVICES=''"):
        cli.main(["--profile", "cpu", "--suite", "kernels", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
