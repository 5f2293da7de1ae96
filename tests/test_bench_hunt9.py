"""The benchmark tools against what a ninth hunt found: a suite whose rows hold no timing (rows
of the previous schema without a median) showed the literal "None" as its kernel headline, an
empty model table and "No kernel rows." placeholders, and said its cases were skipped; the
attention chart drew cases of two dtypes or head shapes as one line; a run on a copy of the
tree whose ``.git`` is of another commit than the sha passed in recorded the tree as dirty."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from report_rows import rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import provenance, report, report_charts  # noqa: E402
from bench.attention_bench import AttentionCase  # noqa: E402
from bench.results import make_row  # noqa: E402

COMMITTED = Path(__file__).parent.parent / "results"


def _section(page: str, heading: str) -> str:
    return re.sub(r"<[^>]+>", " ", page.split(heading)[1].split("<h2>")[0])


@pytest.mark.parametrize("name, suite, noun, n", [("kernels-cpu.json", "kernels", "kernel", 8),
                                                  ("model-cpu.json", "model", "model", 4)])
def test_a_suite_whose_rows_hold_no_timing_says_so(tmp_path, name, suite, noun, n):
    """Schema-1 rows without a median read as not timed (their other figures kept): the kernel
    headline was the word "None", the model headline an empty table, the charts said there
    were no rows, and the reason given was that every case had been skipped."""
    old = json.loads((COMMITTED / name).read_text())
    for r in old["rows"]:
        r.pop("median_us", None)
    path = tmp_path / name
    path.write_text(json.dumps(old))
    page = report.write_report([path], [], tmp_path / "r.html").read_text()
    says = f"None of the {n} {noun} cases was timed and verified"
    headline = "Headline: kernels" if suite == "kernels" else "Headline: whole-model"
    chart = "x floor</h2>" if suite == "kernels" else "Graph vs eager"
    for part in (_section(page, headline), _section(page, chart)):
        assert says in part, part[:300]
        assert "skipped" not in part
    assert '<p class="bad">None</p>' not in page
    assert f"No {noun} rows." not in page


def test_attention_cases_of_two_dtypes_or_head_shapes_are_drawn_apart():
    """The chart named its lines by regime, length, prefix and provider: cases of another dtype
    or head shape shared a line, its points zig-zagging between the two."""
    att = [r for r in rows() if r["suite"] == "attention"]

    def like(r, **shape):
        case = AttentionCase("decode", r["requests"], 512, **shape)
        return make_row(case, "gpu", {}, verification=r["verification"],
                        derived=r["derived"]) | {"stats": r["stats"]}

    other = [like(r, dtype="float16") for r in att]
    heads = [like(r, heads=64) for r in att]
    alone = {t.name: len(t.x) for t in report_charts.attention(att)[0].data}
    lines = {t.name: len(t.x) for t in report_charts.attention(att + other + heads)[0].data}
    assert len(lines) == 3 * len(alone) and sorted(lines.values()) == sorted(
        list(alone.values()) * 3)
    assert any("dtype=float16" in n for n in lines) and any("heads=64" in n for n in lines)
    assert not any("dtype=" in n for n in alone)


@pytest.fixture
def head_sha() -> str:
    if not (provenance.ROOT / ".git").exists():
        pytest.skip("a copy without .git records git_dirty null anyway")
    sha = provenance._git("rev-parse", "--verify", "HEAD")
    if sha is None:
        pytest.skip("git cannot read this repository")
    return sha


def test_a_stale_git_beside_the_sha_passed_in_leaves_dirtiness_unknown(monkeypatch, head_sha):
    """A copy of the tree (a lent GPU machine) passes its commit in ``MULTILORA_GIT_SHA`` and
    may carry the ``.git`` of an older commit: git compared the tree with that commit and the
    run was recorded as dirty (the README called the committed runs' flag an artefact)."""
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.setenv("MULTILORA_GIT_SHA", "0" * 40)
    assert provenance._dirty() is None
    assert provenance.collect(provenance.torch.device("cpu"))["git_dirty"] is None
    status = provenance._git("status", "--porcelain", "--untracked-files=no")
    for passed in (head_sha, head_sha[:7]):  # the sha of the .git: its status tells
        monkeypatch.setenv("MULTILORA_GIT_SHA", passed)
        assert provenance._dirty() is bool(status)
    monkeypatch.delenv("MULTILORA_GIT_SHA")
    assert provenance._dirty() is bool(status)


def test_the_range_table_sums_a_range_s_occurrences_into_one_section():
    """Without nsys the table printed one section per occurrence: 26 "buffer refresh" and 17
    "replay" sections for one CPU model case, hundreds for a GPU one. A range is now one
    section under the ranges around it (``case > replay``), its occurrences counted."""
    from bench.profile import range_table

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for case in ("case a", "case b"):
            with torch.profiler.record_function(case):
                for _ in range(3):
                    with torch.profiler.record_function("replay"):
                        torch.ones(4).add_(1)
    text = range_table(prof.events(), cuda=False)
    heads = [ln for ln in text.splitlines() if ln and not ln.startswith(" ")][1:]
    assert sorted(h.split("  (")[0] for h in heads) == [
        "case a", "case a > replay", "case b", "case b > replay"], text
    assert all("3 times" in h for h in heads if "replay" in h), text


def test_repeated_filters_select_the_cases_matching_any():
    """``--filter A --filter B`` kept only B's cases, silently."""
    from bench import cli

    args = cli.parse_args(["--profile", "cpu", "--filter", "^kernels ", "--filter", "^idle "])
    chosen = cli.select(args, "cpu")
    assert set(chosen) == {"kernels", "idle"}, sorted(chosen)
    assert cli.parse_args([]).filter == "" and cli.parse_args(["--filter", "x"]).filter == "x"
    with pytest.raises(SystemExit, match=r"--filter '\(' is not a valid regex"):
        cli.parse_args(["--filter", "^idle ", "--filter", "("])
