"""The HTML report: one self-contained file whose every chart draws in a real browser
(headless Chromium) with no page errors, for rows of every suite and a baseline; and the CPU
profile end to end (results, reproduce commands, report)."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from browser import chromium, render
from report_rows import RUN, rows

pytest.importorskip("plotly", reason="the report needs plotly (pip install plotly)")
from bench import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")


def _write(tmp_path: Path, name: str, data_rows: list[dict]) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"schema": 2, "runs": {RUN["run_id"]: RUN}, "rows": data_rows}))
    return p


def test_report_is_self_contained_and_flags_regressions(tmp_path):
    cur = _write(tmp_path, "cur.json", rows(scale=1.0))
    base = _write(tmp_path, "base.json", rows(scale=0.8))
    out = report.write_report([cur], [base], tmp_path / "r.html")
    page = out.read_text()
    assert "<script src=" not in page, "the report must not load scripts from the network"
    assert "REGRESSION" in page
    for placeholder in report.PLACEHOLDERS.values():
        assert html.escape(placeholder) not in page, "rows of every suite: no placeholder"
    bare = report.write_report([_write(tmp_path, "k.json", rows()[:4])], [], tmp_path / "b.html")
    assert all(html.escape(p) in bare.read_text() for p in report.PLACEHOLDERS.values())


def test_model_charts_keep_decode_and_prefill_apart_and_show_lora_s_floor():
    from bench import report_charts

    figs = {f.layout.title.text: f for f in report_charts.model_lora_cost(rows())}
    decode = figs["LoRA cost over the runtime without LoRA: llama3-8b L=4"]
    prefill = figs["LoRA cost over the runtime without LoRA: llama3-8b L=4 prefill"]
    graph = {t.name: dict(zip(t.x, t.y, strict=True)) for t in decode.data}
    # decode at bs 8: LoRA graph step 1400 over 1200 us; the prefill's (x3) would read the same
    # ratio, so the replay's floor tells them apart: 11 * sqrt(8) us over 1100 (x3 prefill)
    assert graph["adapters=4 r=16 lora traffic, graph"][8] == pytest.approx(100 * (1400 / 1200 - 1))
    floor = graph["adapters=4 r=16, LoRA's bytes floor"]
    assert floor[8] == pytest.approx(100 * 11 * 8 ** 0.5 / 1100)
    assert {t.name for t in prefill.data} >= {"adapters=4 r=16, LoRA's bytes floor"}
    assert [t.x for t in prefill.data if "floor" in t.name][0] == (8,)


@needs_chromium
def test_every_chart_draws_without_errors(tmp_path):
    out = report.write_report([_write(tmp_path, "cur.json", rows())],
                              [_write(tmp_path, "base.json", rows(scale=0.8))],
                              tmp_path / "r.html")
    drawn, total, errors = render(out)
    assert total >= 10, f"expected charts of every suite, found {total}"
    assert drawn == total, f"{total - drawn} of {total} charts did not draw"
    assert errors == [], f"page errors: {errors}"


@needs_chromium
def test_browser_check_catches_a_broken_page(tmp_path):
    out = report.write_report([_write(tmp_path, "cur.json", rows())], [], tmp_path / "r.html")
    page = out.read_text().replace("</body>", "<script>undefinedFunction();</script>"
                                   '<div class="plotly-graph-div"></div></body>')
    out.write_text(page)
    drawn, total, errors = render(out)
    assert drawn == total - 1 and errors, "the check must see an undrawn chart and the error"


def test_cpu_profile_end_to_end(tmp_path):
    """A reduced CPU run, every suite (one kernel case, two model cases, the idle forward and a
    base batch, DP size 2 with LoRA on gloo ranks, Triton decode attention): result files with
    verified rows whose reproduce command selects exactly their case, and the report."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "bench", "--profile", "cpu", "--out", str(out), "--filter",
           "qkv_proj T=1 |bs=1 (no-lora|adapters=2 r=8$)|idle_forward|dp size=2 .*adapters|"
           "attention decode .* triton|base_step .* bs=1 "]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "CPU times are wall clock" in p.stdout
    files = sorted(f.name for f in out.glob("*.json"))
    assert files == [f"{s}-cpu.json" for s in ("attention", "base_step", "dp", "idle", "kernels",
                                               "model")]
    for f in files:
        data = json.loads((out / f).read_text())
        assert data["schema"] == 2 and data["rows"]
        for r in data["rows"]:
            assert r["verification"]["status"] == "verified", r["label"]
            assert r["stats"]["n"] == len(r["samples_us"]) > 0
            flt = re.search(r"--filter '(.*)'$", r["reproduce"]).group(1)
            assert re.search(flt, r["label"]) and not re.search(flt, r["label"] + " x")
        run = next(iter(data["runs"].values()))
        assert run["git_sha"] and "git_dirty" in run and run["torch"]
    labels = {r["label"] for r in json.loads((out / "model-cpu.json").read_text())["rows"]}
    assert labels == {"model decode tiny L=2 ctx=16 bs=1 no-lora",
                      "model decode tiny L=2 ctx=16 bs=1 adapters=2 r=8"}
    page = out / "report.html"
    assert page.exists()
    if chromium() is not None:
        drawn, total, errors = render(page)
        assert drawn == total > 0 and errors == []
