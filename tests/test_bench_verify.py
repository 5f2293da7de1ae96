"""A model benchmark case is verified before it is timed: a graph step that differs from the
eager forward, or static LoRA buffers that are not neutral past the batch, make the case
"failed" with the error, and nothing of it is timed."""

from __future__ import annotations

import pytest
import torch

from bench.context import Context
from bench.hardware import Ceilings
from bench.logits_match import assert_logits_match
from bench.model_bench import ModelCase, RuntimeCache, run_case
from bench.model_runtime import BenchRuntime
from bench.timing import Timing, bench_interleaved, pair_difference, pair_ratio

CPU = torch.device("cpu")
CTX = Context(CPU, Ceilings("cpu", 10.0, 0.1, 0), reps=2, profile="cpu")


def _cases():
    return [ModelCase("decode", "tiny", 2, 16, bs, 2, (8,), "torch", torch.float32)
            for bs in (1, 4)]


def _wrong_logits(self, batch):
    return BenchRuntime.graphs_step(self, batch) + 1.0


def _stale_padding(self, batch):
    out = BenchRuntime.graphs_step(self, batch)
    full = self.graphs.lora_buffers.tokens.view(self.graphs.lora_buffers.tokens.max_rows)
    full.token_slots[batch.num_tokens:] = 0  # a real adapter's slot on padding rows
    return out


@pytest.mark.parametrize("fault, message", [(_wrong_logits, "differs from the eager"),
                                            (_stale_padding, "neutral slot")])
def test_a_case_failing_verification_is_failed_and_not_timed(monkeypatch, fault, message):
    monkeypatch.setattr(BenchRuntime, "graphs_step", BenchRuntime.step, raising=False)
    monkeypatch.setattr(BenchRuntime, "step", fault)
    cases = _cases()
    rows = run_case(cases[0], CTX, RuntimeCache(cases, CPU))
    assert len(rows) == 1
    row = rows[0]
    assert row["verification"]["status"] == "failed" and message in row["verification"]["error"]
    assert row["stats"] is None and row["samples_us"] == []


def test_a_verified_case_times_every_traffic_and_path():
    cases = _cases()
    rows = run_case(cases[0], CTX, RuntimeCache(cases, CPU))
    assert {(r["traffic"], r["path"]) for r in rows} == {
        (t, p) for t in ("base", "lora") for p in ("eager", "graph", "replay_only")}
    assert all(r["verification"]["status"] == "verified" and r["stats"]["n"] == 2 for r in rows)
    eager = {r["traffic"]: r for r in rows if r["path"] == "eager"}
    want = pair_ratio(*(Timing(eager[t]["samples_us"], "wall") for t in ("lora", "base")))
    assert eager["lora"]["derived"]["eager_lora_over_base"] == want > 0
    assert "eager_lora_over_base" not in eager["base"]["derived"]
    # LoRA traffic rows carry the batch's adapters' bytes floor, base traffic rows none
    floors = {r["derived"].get("lora_floor_us") for r in rows if r["traffic"] == "lora"}
    assert len(floors) == 1 and floors.pop() > 0
    assert all("lora_floor_us" not in r["derived"] for r in rows if r["traffic"] == "base")
    # graph steps and replays were timed alternating: their pairs give the host's share and
    # LoRA traffic's ratio to base traffic's
    got = {(r["traffic"], r["path"]): Timing(r["samples_us"], "wall") for r in rows}
    by = {(r["traffic"], r["path"]): r["derived"] for r in rows}
    for traffic in ("base", "lora"):
        assert by[(traffic, "graph")]["host_us"] == pair_difference(
            got[(traffic, "graph")], got[(traffic, "replay_only")])
    for path in ("graph", "replay_only"):
        assert by[("lora", path)]["lora_over_base_traffic"] == pair_ratio(
            got[("lora", path)], got[("base", path)]) > 0
        assert "lora_over_base_traffic" not in by[("base", path)]


def test_interleaved_timing_alternates_its_functions_and_pairs_their_reps():
    calls = []
    t = bench_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                          device=CPU, warmup=1, reps=3)
    assert calls == ["a", "b"] * 4 and len(t["a"].samples_us) == len(t["b"].samples_us) == 3
    ratio = pair_ratio(Timing([2.0, 9.0, 4.0], "wall"), Timing([1.0, 3.0, 1.0], "wall"))
    assert ratio == 3.0  # the median of 2, 3 and 4: each rep against its own partner
    assert pair_difference(Timing([5.0, 9.0, 4.0], "wall"), Timing([1.0, 3.0, 1.0], "wall")) == 4
    calls.clear()  # "events" (a GPU's stream time) is the wall clock on a CPU
    t = bench_interleaved({"b": lambda: calls.append("b"), "a": lambda: calls.append("a")},
                          device=CPU, warmup=0, reps=2, mode="events")
    assert calls == ["b", "a"] * 2 and t["a"].mode == "wall"
    with pytest.raises(ValueError, match="mode must be 'latency' or 'events'"):
        bench_interleaved({"a": lambda: None}, device=CPU, mode="graph")


@pytest.mark.parametrize(("layers", "margin", "fails"), [
    (4, 0.15, True),  # a clear margin at 4 layers: the flipped token fails the check
    (32, 0.15, False),  # within the noise 32 layers add (margin limit 0.1 x sqrt(8))
    (32, 0.35, True),
])
def test_a_flipped_greedy_token_fails_where_its_margin_is_clear_for_the_depth(layers, margin,
                                                                              fails):
    want = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want[0, :2] = torch.tensor([5.0, 5.0 - margin])
    got = want.clone()
    got[0, :2] = torch.tensor([5.0 - margin, 5.0])  # the top two swapped: row error ~0.05
    if fails:
        with pytest.raises(AssertionError, match="1 greedy tokens differ"):
            assert_logits_match(got, want, torch.bfloat16, "case", layers)
    else:
        assert assert_logits_match(got, want, torch.bfloat16, "case", layers) < 0.085


def test_nan_logits_never_match_in_bf16():
    """A row error of nan is not above the limit: a replay giving NaN was verified and timed."""
    want = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = want.clone()
    got[1, 3] = float("nan")
    for g, w in ((got, want), (got, got)):
        with pytest.raises(AssertionError, match="worst row relative error nan"):
            assert_logits_match(g, w, torch.bfloat16, "case")


def test_a_flip_within_the_rows_broad_noise_is_not_a_clear_margin():
    """Every logit of the row moved (rounding through 4 layers): a top-2 margin of 0.12 is
    within ten of its sigmas; the same flip with the rest of the row unmoved fails."""
    g = torch.Generator().manual_seed(1)
    want = torch.randn(2, 4096, generator=g)
    want[0, :2] = torch.tensor([9.0, 8.88])
    noisy = want + 0.02 * torch.randn(2, 4096, generator=g)
    noisy[0, :2] = torch.tensor([8.88, 9.0])
    assert assert_logits_match(noisy.bfloat16(), want.bfloat16(), torch.bfloat16, "case") < 0.03
    quiet = want.clone()
    quiet[0, :2] = torch.tensor([8.88, 9.0])
    with pytest.raises(AssertionError, match="1 greedy tokens differ"):
        assert_logits_match(quiet.bfloat16(), want.bfloat16(), torch.bfloat16, "case")
