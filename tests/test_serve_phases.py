"""``bench.serve_phases``: the phase split of serving passes, end to end on the CPU stand-in,
and the instrumentation leaving no wrapper behind (also when the block raises)."""

from __future__ import annotations

import re

import pytest
import torch

from bench import serve_phases


def _methods():
    return [owner.__dict__[name] for owner, name, _ in serve_phases.PHASES]


def test_phases_of_both_runtimes_and_the_methods_restored(capsys):
    before = _methods()
    assert serve_phases.main(["--passes", "1", "--adapters", "2", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "mean nothing as performance figures" in err, "CPU times are flagged"
    assert _methods() == before
    for mode in ("decode", "extend"):
        block = out.split(f"{mode}: ")[1].split("\n\n\n")[0]
        cells = [re.split(r"\s{2,}", line.strip()) for line in block.splitlines()[4:13]]
        rows = {c[0]: [float(x) for x in c[1:]] for c in cells}
        assert list(rows) == list(serve_phases.ROWS)
        assert rows["replay"][1] > 0 and rows["step"][0] >= rows["replay"][0] > 0
        assert rows["lora plan+layouts"][1] > 0, "the LoRA runtime plans its batches"
        assert rows["lora plan+layouts"][0] == 0, "the base runtime has no LoRA phase"
    assert "% of base (median walls)" in out


def test_instrumentation_is_removed_when_the_block_raises():
    before = _methods()
    with pytest.raises(RuntimeError, match="boom"), \
            serve_phases.instrumented(torch.device("cpu")):
        assert _methods() != before
        raise RuntimeError("boom")
    assert _methods() == before
