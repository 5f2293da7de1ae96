"""Benchmark tools against what a seventh hunt found: a ``bench.dp_bench`` row's reproduce
command was a ``python -m bench`` one that matched no case of the profile (or ran the profile's
workload, not the tool's); the report's change against a baseline named rows of two devices
alike, so its table held look-alike lines and its chart drew one bar over the other;
``bench.attention_bench --sweep`` ran GPU-sized cases in the CPU interpreter for hours, and
ignored ``--quick``; ``dp_bench`` ran a case given twice twice, into two rows of one run;
the shared nox environment, its interpreter gone, was made anew without its packages."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from report_rows import RUN, rows
from test_noxfile_env import FakeSession, _noxfile, _torch_install

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from cli_checks import never, usage_error  # noqa: E402

from bench import attention_bench, dp_bench, report, results  # noqa: E402
from bench.results import make_row  # noqa: E402
from bench.scenarios import DPCase  # noqa: E402

DP = ["--preset", "tiny", "--layers", "1", "--requests-per-rank", "3", "--prompt", "5",
      "--output", "2", "--max-batch", "2", "--adapters", "0", "2", "--rank", "4",
      "--loads", "balanced", "--serial"]


def _spawn_writing_rows(calls: list):
    """A stand-in for the spawn: records what the ranks were asked to run and writes rank 0's
    rows, one a case, as ``dp_bench.run_rank`` does."""
    def spawn(fn, nprocs, size, opts, part, timeout_s):
        calls.append((size, opts))
        out = []
        for c in opts["cases"]:
            a = c["adapters"]
            case = DPCase(opts["preset"], opts["layers"], "float32", size, c["load"], a,
                          str(c["rank"]) if a else "-")
            out.append(make_row(case, opts["profile"], {},
                                verification={"status": "verified", "error": None}))
        with open(part, "w") as f:
            json.dump(out, f)
    return spawn


def test_a_dp_bench_row_reproduces_its_case_with_the_tool_s_workload(monkeypatch, tmp_path):
    """The row said ``python -m bench --profile cpu --suite dp --filter '^dp size=2 balanced
    tiny L=1 adapters=2 r=4$'``: the CPU profile has no balanced case (an error listing the
    labels), and where a label matched, it ran the profile's workload, not ``--prompt 5``."""
    calls = []
    monkeypatch.setattr(dp_bench, "spawn", _spawn_writing_rows(calls))
    out = tmp_path / "dp.json"
    assert dp_bench.main(DP + ["--sizes", "1", "2", "--out", str(out)]) == 0
    written = results.load(out)["rows"]
    assert len(written) == 4
    for row in written:
        argv = shlex.split(row["reproduce"])
        assert argv[:3] == ["python", "-m", "bench.dp_bench"], row["reproduce"]
        calls.clear()
        assert dp_bench.main(argv[3:]) == 0  # the command runs this case alone
        [(size, opts)] = calls
        assert size == row["dp_size"]
        assert opts["cases"] == [{"adapters": row["adapters"], "load": "balanced", "rank": 4}]
        assert (opts["requests_per_rank"], opts["prompt"], opts["output"], opts["max_batch"],
                opts["overlap"]) == (3, 5, 2, 2, False)


def test_the_change_against_a_baseline_names_the_device_of_each_row():
    """Rows of two devices, each against its own baseline: both were named ``kernels qkv_proj
    T=1 adapters=1 r=16 [triton]``, one line 1.000 and one 2.000, and the chart's bars of one
    name stood in one slot."""
    a, b = RUN | {"run_id": "a", "device": "GPU A"}, RUN | {"run_id": "b", "device": "GPU B"}
    runs = {"a": a, "b": b}
    now = report.with_device([r | {"run_id": "a"} for r in rows(1.0)]
                             + [r | {"run_id": "b"} for r in rows(2.0)], runs)
    then = report.with_device([r | {"run_id": "a"} for r in rows(1.0)]
                              + [r | {"run_id": "b"} for r in rows(1.0)], runs)
    _, pairs = report.deltas(now, then)
    names = [name for name, _ in pairs]
    assert len(set(names)) == len(names)
    ratio = dict(pairs)
    assert [ratio[n] for n in names if n.startswith("kernels qkv_proj T=1 adapters=1 r=16 "
                                                    "[triton]")] == [1.0, 2.0]
    assert any("GPU A" in n for n in names) and any("GPU B" in n for n in names)
    # One device: the names stay as they were.
    _, pairs = report.deltas([r for r in now if r["device"] == "GPU A"], then)
    assert "kernels qkv_proj T=1 adapters=1 r=16 [triton]" in dict(pairs)


@pytest.mark.parametrize("argv, says", [
    (["--sweep"], "--sweep times launch variants of Llama-3-8B-sized cases on a GPU"),
    (["--sweep", "--quick"], "--sweep runs its own cases (launch variants): drop --quick"),
])
def test_attention_bench_refuses_a_sweep_it_would_not_run_as_asked(monkeypatch, capsys, argv,
                                                                   says):
    """Without a GPU, ``--sweep`` ran Llama-3-8B-sized cases in the Triton interpreter (3 s a
    call for the smallest, the largest 32 times that, 31 calls a case); with ``--quick`` the
    sweep's cases ran and ``--quick`` was ignored."""
    monkeypatch.setattr(attention_bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(attention_bench, "run_attention_suite", never)
    usage_error(capsys, attention_bench.main, argv, says)


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "1", "2", "1"], "--sizes 1 2 1: 1 is given twice"),
    (["--adapters", "0", "0"], "--adapters 0 0: 0 is given twice"),
    (["--loads", "skewed", "balanced", "skewed"],
     "--loads skewed balanced skewed: skewed is given twice"),
])
def test_dp_bench_refuses_a_value_given_twice(monkeypatch, capsys, tmp_path, argv, says):
    """The case ran twice and the result file held two rows of it from one run (the report
    showed one, the tool's exit named both); a size given twice spawned its ranks twice."""
    monkeypatch.setattr(dp_bench, "spawn", never)
    base = [a for a in DP if a != "--serial"]
    usage_error(capsys, dp_bench.main, base + argv + ["--out", str(tmp_path / "dp.json")], says)
    assert list(tmp_path.iterdir()) == []


class _VenvSession(FakeSession):
    """As nox and ``python -m venv`` do: a program that is not there is an error, and a venv
    made over an existing folder keeps the links it finds (a dangling one too)."""

    def run(self, *args):
        if args[0] != sys.executable and not Path(args[0]).exists():
            raise RuntimeError(f"Program {args[0]} not found")
        self.runs.append(args)
        if "venv" in args:
            python = Path(args[-1], "bin", "python")
            python.parent.mkdir(parents=True, exist_ok=True)
            if not python.is_symlink():
                python.touch()


def test_a_shared_environment_whose_interpreter_is_gone_is_made_anew(monkeypatch, tmp_path):
    """Its ``bin/python`` a dangling link (the Python it was made with removed or upgraded):
    nox made a venv over the folder, which kept the link, so every session failed on
    "Program .nox/shared/bin/python not found" until the folder was deleted by hand (and had
    the venv mended it, the old stamp skipped installing the packages)."""
    nf = _noxfile(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    nf._python(_VenvSession())
    python = tmp_path / ".nox/shared/bin/python"
    python.unlink()
    python.symlink_to(tmp_path / "gone/python3.11")
    again = _VenvSession()
    nf._python(again)
    assert _torch_install(again) is not None
    assert any("-e" in r for r in again.runs)
