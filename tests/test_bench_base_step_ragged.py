"""The base step suite verified only the batch it times: every request at one context length
with token id 1. A decode attention that masks by the batch's longest context instead of each
request's, or an embedding lookup wrong for high token ids, was verified in every suite of the
CPU profile (whose batches never mix context lengths). Each case now also verifies, untimed,
a ragged batch of its bucket: unequal contexts, last tokens spread down from the highest id."""

from __future__ import annotations

import pytest
import torch
from bench_faults import mask_by_longest

from bench import base_step_suite
from bench.context import Context
from bench.hardware import Ceilings

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=1, profile="cpu")


def _high_ids_off(monkeypatch):
    real = torch.nn.Embedding.forward

    def lookup(self, ids):
        return real(self, torch.where(ids >= self.num_embeddings - 6, ids - 1, ids))

    monkeypatch.setattr(torch.nn.Embedding, "forward", lookup)


@pytest.mark.parametrize("fault", [None, "mask-by-longest", "high-ids-off"])
def test_base_step_verifies_a_ragged_batch(monkeypatch, fault):
    if fault == "mask-by-longest":
        mask_by_longest(monkeypatch)
    elif fault == "high-ids-off":
        _high_ids_off(monkeypatch)
    case = base_step_suite.cases("tiny", 1, "float32", (3,), (16,), ("torch",))[0]
    row = base_step_suite.make_runner([case], CTX)(case)[0]
    v = row["verification"]
    if fault is None:
        assert v["status"] == "verified" and v["ragged_max_rel_err_vs_float64"] < 1e-5, v
    else:
        assert v["status"] == "failed" and "ragged" in v["error"], v
        assert row["stats"] is None
