"""``python -m bench.report [RESULT FILES or RUN FOLDERS ...] [--baseline PATH]... -o
report.html``: one self-contained HTML file (plotly.js inline, opens offline) with the
environment of each run, headline tables, verification status, the charts of
``bench.report_charts`` (placeholders where a suite has no rows yet) and, with
``--baseline``, the change of every case's median time, regressions flagged.

Without paths: the newest run folder under ``results/runs/`` that holds result files. JSON
files of a folder that are not result files (a profiler trace) are skipped with a note; rows of
a case run more than once are shown from the latest run; each device gets its own tables and
charts."""

from __future__ import annotations

import argparse
import html
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import plotly.io as pio
from plotly.offline import get_plotlyjs

from bench import report_charts as charts
from bench import results, table
from bench.provenance import ROOT

REGRESSION = 1.10  # a case this much slower than the baseline is flagged

PLACEHOLDERS = {
    "base_step": "No base-step rows (suite 'base_step').",
    "attention": "No attention rows (suite 'attention').",
    "throughput": "No throughput rows yet (suite 'throughput': offline workloads at several "
                  "adapter counts and popularity; fields in bench/scenarios.py).",
    "idle": "No idle-path rows yet (suite 'idle': idle forward and base-only batch, LoRA "
            "runtime vs runtime without LoRA; fields in bench/scenarios.py).",
    "dp": "No DP rows yet (suite 'dp': DP sizes, balanced and skewed load; fields in "
          "bench/scenarios.py).",
}


def _table(headers: list[str], rows: list[list], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, Markup) else html.escape(str(c))}"
                                    f"</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class Markup(str):
    """Table cell HTML that is not escaped."""


def environment(runs: dict) -> str:
    heads = ["run", "profile", "device", "driver", "git sha", "python", "torch", "CUDA",
             "triton", "copy GB/s", "matmul TFLOP/s", "suite seconds"]
    rows = []
    for rid, r in sorted(runs.items()):
        c = r.get("ceilings") or {}
        dirty = {True: " (dirty)", None: " (dirty: unknown)"}.get(r.get("git_dirty"), "")
        secs = ", ".join(f"{k} {table.fmt(v, '.0f')}"
                         for k, v in (r.get("suite_seconds") or {}).items())
        profiled = f" (under {r['profiled_by']})" if r.get("profiled_by") else ""
        rows.append([rid, (r.get("profile") or "") + profiled, r.get("device", ""),
                     r.get("driver", ""), str(r.get("git_sha") or "")[:10] + dirty,
                     r.get("python", ""), r.get("torch", ""), r.get("cuda", ""),
                     r.get("triton", ""), table.fmt(c.get("copy_gbps"), ".0f"),
                     table.fmt(c.get("matmul_tflops"), ".1f"), secs or "-"])
    return _table(heads, rows)


def verification(rows: list[dict]) -> str:
    count: dict[tuple, int] = {}
    for r in rows:
        k = (r["suite"], r["verification"]["status"])
        count[k] = count.get(k, 0) + 1
    out = _table(["suite", "status", "rows"], [[s, v, n] for (s, v), n in sorted(count.items())])
    failed = {results.case_id(r): r for r in rows if r["verification"]["status"] == "failed"}
    bad = [[r["label"], r["verification"].get("error") or "", r.get("reproduce", "")]
           for r in failed.values()]
    if bad:
        out += "<h3>Failed cases</h3>" + _table(["case", "error", "reproduce"], bad, "bad")
    return out + "<h3>What the verified rows checked</h3>" + _table(
        ["suite", "checks", "worst recorded error", "reference tokens differing past a tie"],
        checked(rows))


def checked(rows: list[dict]) -> list[list[str]]:
    """Per suite, over its verified rows: the checks made, the worst of each recorded error
    (``*err*`` fields of the verification) and the tokens that differed from the engine-free
    reference past its near-tie, within the bf16 allowance (``bench.token_reference``)."""
    suites: dict[str, tuple[list, dict, list]] = {}
    for r in rows:
        v = r["verification"]
        if v.get("status") != "verified":
            continue
        checks, worst, tokens = suites.setdefault(r["suite"], ([], {}, [0, 0]))
        for c in v.get("checks") or ([v["checked"]] if v.get("checked") else []):
            if c not in checks:
                checks.append(c)
        for k, x in v.items():
            if "err" in k and isinstance(x, (int, float)) and not isinstance(x, bool):
                worst[k] = max(worst.get(k, x), x)
        if isinstance(v.get("reference_probes"), int) and isinstance(
                v.get("reference_mismatches") or 0, int):
            tokens[0] += v.get("reference_mismatches") or 0
            tokens[1] += v["reference_probes"]
    return [[suite, "; ".join(checks) or "-",
             ", ".join(f"{k} {table.fmt(x, '.2g')}" for k, x in sorted(worst.items())) or "-",
             f"{d} of {n}" if n else "-"]
            for suite, (checks, worst, (d, n)) in sorted(suites.items())]


def _timed(r: dict) -> bool:
    m = (r.get("stats") or {}).get("median_us")
    return isinstance(m, (int, float)) and math.isfinite(m) and m > 0


def deltas(rows: list[dict], base_rows: list[dict]) -> tuple[str, list]:
    base = {(r.get("device"), results.row_id(r)): r for r in base_rows if _timed(r)}
    # A case of two devices is two lines and two bars: their names must differ.
    several = len({r.get("device") for r in rows}) > 1

    def name(r):
        variant = " ".join(str(r.get(k)) for k in r["variant"])
        return f"{r['label']} [{variant}]" + (
            f" on {r.get('device') or 'unknown device'}" if several else "")

    # A failed case is one row whose variant may match none of its timed rows (a model
    # case's "all"): each of the case's rows timed in the baseline and not now fails now.
    failing = {(r.get("device"), results.case_id(r)) for r in rows
               if r["verification"]["status"] == "failed"}
    timed = {(r.get("device"), results.row_id(r)) for r in rows if _timed(r)}
    cells = [[name(b), table.fmt(b["stats"]["median_us"]), "failed", "-",
              Markup('<span class="bad">FAILS NOW</span>')]
             for (device, rid), b in base.items()
             if (device, results.case_id(b)) in failing and (device, rid) not in timed]
    pairs, broken = [], len(cells)
    for r in rows:
        b = base.get((r.get("device"), results.row_id(r)))
        if b is None or not _timed(r):
            continue
        ratio = r["stats"]["median_us"] / b["stats"]["median_us"]
        pairs.append((name(r), ratio))
        flag = ("REGRESSION" if ratio > REGRESSION else
                "faster" if ratio < 1 / REGRESSION else "")
        cells.append([name(r), table.fmt(b["stats"]["median_us"]),
                      table.fmt(r["stats"]["median_us"]), f"{ratio:.3f}",
                      Markup(f'<span class="{"bad" if ratio > REGRESSION else ""}">{flag}</span>')])
    cells.sort(key=lambda c: -float(c[3]) if c[3] != "-" else -math.inf)
    regressions = sum(1 for _, v in pairs if v > REGRESSION)
    head = (f"<p>{len(pairs)} rows in both runs; <b>{regressions}</b> more than "
            f"{100 * (REGRESSION - 1):.0f}% slower than the baseline.</p>")
    if broken:
        head += (f'<p class="bad"><b>{broken}</b> rows timed in the baseline fail now (see '
                 "Failed cases).</p>")
    if not pairs and not broken:
        mine = sorted({str(r.get("device")) for r in rows})
        theirs = sorted({str(r.get("device")) for r in base_rows})
        why = (f"the baseline's devices ({', '.join(theirs) or 'none'}) are not this run's "
               f"({', '.join(mine) or 'none'}): compare runs of one device"
               if not set(mine) & set(theirs) else
               "no timed case of this run is in the baseline (other suites, presets or "
               "profiles?)")
        head += f'<p class="bad">Nothing compared: {html.escape(why)}.</p>'

    return head + _table(["case [variant]", "baseline us", "this run us", "ratio", ""],
                         cells), pairs


def kernel_headline(rows: list[dict]) -> str:
    """Per module and token count (of one preset and dtype), the case with the most adapters
    and the highest rank; the full table folded below."""
    if not rows:
        return "<p>No kernel rows.</p>"

    def key(r):
        return r.get("device"), r.get("preset"), r.get("dtype"), r["module"], r["tokens"]

    top: dict[tuple, tuple] = {}
    for r in rows:  # a case that failed or was not timed has no cells: not the headline's
        if r.get("stats") and r["verification"]["status"] != "failed":
            top[key(r)] = max(top.get(key(r), (0, 0)), (r["adapters"], r["rank"]))
    head = [r for r in rows if top.get(key(r)) == (r["adapters"], r["rank"])]
    n = len({results.case_id(r) for r in rows})
    shown = (_table(*table.kernel_cells(head)) if head else
             f'<p class="bad">{_none_timed(rows, "kernels")}</p>')
    return (shown + f"<details><summary>all {n} kernel cases"
            f"</summary>{_table(*table.kernel_cells(rows))}</details>")


def with_device(rows: list[dict], runs: dict) -> list[dict]:
    """Rows with their run's device, so rows of different devices are never one case."""
    return [r | {"device": runs.get(r.get("run_id"), {}).get("device") or ""}  # null: unknown
            for r in rows]


def per_device(rows: list[dict], section) -> str:
    """``section(rows, device)`` once per device, under the device's name when there are
    several (a CPU interpreter figure must never stand beside or replace a GPU one)."""
    devices = sorted({r.get("device", "") for r in rows})
    if len(devices) <= 1:
        return section(rows, "")
    return "".join(f"<h3>{html.escape(d or 'unknown device')}</h3>"
                   + section([r for r in rows if r.get("device", "") == d], d)
                   for d in devices)


FROM_DERIVED = ("throughput", "dp")
"""Suites whose tables and charts draw a row's derived figures without its timing (tokens/s);
the others' draw its ``stats``."""


def _none_timed(rows: list[dict], suite: str) -> str | None:
    """Where ``rows`` hold cases of ``suite`` but none with figures that passed: says so (a
    placeholder saying there are no rows misled where every case had failed, or held no
    timing: rows of schema 1 without a median)."""
    mine = [r for r in rows if r["suite"] == suite]

    def drawn(r):
        return r.get("stats") or (suite in FROM_DERIVED and r.get("derived"))

    if not mine or any(r["verification"]["status"] not in ("failed", "skipped") and drawn(r)
                       for r in mine):
        return None
    n = len({results.case_id(r) for r in mine})
    status = {r["verification"]["status"] for r in mine}
    why = ("see Failed cases" if "failed" in status else
           "every one was skipped (see Verification)" if status == {"skipped"} else
           "their rows hold no timing")
    noun = "kernel" if suite == "kernels" else suite
    return f"None of the {n} {noun} cases was timed and verified: {why}."


def _charts(chart, placeholder: str, suite: str):
    def section(rows, device):
        figs = chart(rows)
        for f in figs if device else ():
            f.update_layout(title=f"{f.layout.title.text} ({device})")
        return _figs_html(figs, _none_timed(rows, suite) or placeholder)
    return section


def _figs_html(figs, placeholder: str = "") -> str:
    if not figs:
        return f'<p class="placeholder">{html.escape(placeholder)}</p>'
    return "".join(pio.to_html(f, full_html=False, include_plotlyjs=False,
                               config={"displaylogo": False, "responsive": True})
                   for f in figs)


def build(rows: list[dict], runs: dict, base_rows: list[dict] | None = None,
          base_runs: dict | None = None) -> str:
    rows, superseded = results.latest_per_case(with_device(rows, runs), runs)

    def charts_of(chart, placeholder, suite):
        return per_device(rows, _charts(chart, placeholder, suite))

    parts = [
        "<h1>multilora-graphs benchmark report</h1>",
        ('<p class="bad">CPU runs: their times are wall clock of the Triton interpreter and '
         'Python; they prove the pipeline and mean nothing as performance figures.</p>'
         if any(r.get("device") == "cpu" for r in runs.values()) else ""),
        "<h2>Environment</h2>", environment(runs),
        (f'<p class="note">{superseded} rows superseded by later runs of the same case (only '
         'the latest run of a case is shown).</p>' if superseded else ""),
        "<h2>Verification</h2>", per_device(rows, lambda rs, _: verification(rs)),
        "<h2>Headline: kernels (median us)</h2>",
        per_device([r for r in rows if r["suite"] == "kernels"],
                   lambda rs, _: kernel_headline(rs)),
        "<h2>Headline: whole-model step, decode and prefill (median us)</h2>",
        per_device([r for r in rows if r["suite"] == "model"], lambda rs, _: (
            f'<p class="bad">{_none_timed(rs, "model")}</p>' if _none_timed(rs, "model")
            else _table(*table.model_cells(rs)) if rs else "<p>No model rows.</p>")),
        "<h2>LoRA % of base vs tokens</h2>",
        charts_of(charts.kernel_pct_of_base, "No kernel rows.", "kernels"),
        "<h2>What LoRA adds to a module in a graph</h2>",
        charts_of(charts.kernel_added_to_module, "No module rows.", "kernels"),
        "<h2>x floor</h2>", charts_of(charts.kernel_x_floor, "No kernel rows.", "kernels"),
        "<h2>Graph vs eager</h2>",
        charts_of(charts.model_graph_vs_eager, "No model rows.", "model"),
        "<h2>LoRA cost in the model step</h2>",
        charts_of(charts.model_lora_cost, "No model rows with LoRA.", "model"),
        *(part for suite, title, chart in (
            ("base_step", "Base decode step vs its floor", charts.base_step),
            ("attention", "Attention vs its floor", charts.attention),
            ("throughput", "Throughput vs adapters and popularity", charts.throughput),
            ("idle", "Idle-path overhead", charts.idle), ("dp", "DP scaling", charts.dp))
          for part in (f"<h2>{title}</h2>", charts_of(chart, PLACEHOLDERS[suite], suite))),
    ]
    if base_rows is not None:
        base_runs = base_runs or {}
        base_rows = results.latest_per_case(with_device(base_rows, base_runs), base_runs)[0]
        text, pairs = deltas(rows, base_rows)
        parts += ["<h2>Change vs baseline</h2>", text, _figs_html(charts.deltas(pairs))]
    return PAGE.format(plotly=get_plotlyjs(), body="\n".join(parts))


PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>multilora-graphs benchmark report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child {{ text-align: left; }}
.bad, table.bad td {{ color: #b00; font-weight: 600; }}
.placeholder {{ color: #777; font-style: italic; }}
</style>
<script type="text/javascript">{plotly}</script>
</head><body>
{body}
</body></html>
"""


def write_report(paths: list[Path], baseline: list[Path], out: Path,
                 need_rows: bool = False) -> Path:
    """The report of ``paths`` against ``baseline``; ``need_rows``: no rows is an error."""
    rows, runs = results.rows_of(paths)
    if need_rows and not rows:
        raise SystemExit("no result rows in " + ", ".join(map(str, paths)))
    base_rows, base_runs = results.rows_of(baseline) if baseline else (None, None)
    if baseline and not base_rows:  # "the baseline's devices (none) are not this run's"
        raise SystemExit(f"--baseline {', '.join(map(str, baseline))}: no result rows: give "
                         "the result files or run folder of an earlier run")
    superseded = results.latest_per_case(with_device(rows, runs), runs)[1]
    if superseded:
        print(f"note: {superseded} rows superseded by later runs of the same case (the "
              "report shows the latest run of each case)")
    page = build(rows, runs, base_rows, base_runs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")  # as its <meta charset> says
    except OSError as e:  # a file where a folder of the path should be, a read-only folder
        raise UnwritablePage(f"-o {out}: cannot write the report ({e.strerror}: "
                             f"{e.filename}): give a path in a writable folder") from None
    return out


class UnwritablePage(Exception):
    """The report's HTML file cannot be written; the message names the path."""


def _writable_page(out: Path) -> Path:
    if out.suffix.lower() == ".json":  # it would overwrite a result file given as input, or
        # be read as a corrupt result file by the next report of its folder
        raise SystemExit(f"-o {out}: the report is an HTML page, and a .json file is read as "
                         f"a result file: give an .html path (e.g. {out.with_suffix('.html')})")
    if out.suffix.lower() == ".png":  # --screenshot's kind of file: a slip of the flag
        raise SystemExit(f"-o {out}: the report is an HTML page: give an .html path (e.g. "
                         f"{out.with_suffix('.html')}); --screenshot takes the .png")
    if out.is_dir():
        raise SystemExit(f"-o {out} is a folder: give the HTML file's path "
                         f"(e.g. {out / 'report.html'})")
    return out


def _usable_screenshot(png: Path) -> None:
    """Checked before the report is built: chromium writes wherever it is told, and the file
    there is deleted first (it deleted the report itself, or a result file, when named: the
    report is never a .png, ``_writable_page``)."""
    if png.is_dir():
        raise SystemExit(f"--screenshot {png} is a folder: give the PNG file's path "
                         f"(e.g. {png / 'report.png'})")
    if png.suffix.lower() != ".png":
        raise SystemExit(f"--screenshot {png}: give a .png path (e.g. {png.with_suffix('.png')})")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--screenshot {png}: cannot create its folder ({e.strerror}: "
                         f"{e.filename}): give a path in a writable folder") from None


def newest_run_folder(runs_dir: Path) -> Path | None:
    """The newest run folder (``<YYYYmmdd-HHMMSS>-<device>``) holding result files. A profile
    session's folder (``...-profile``) is not one: its case was timed under a profiler."""
    folders = sorted((p for p in runs_dir.glob("*/") if p.name[:8].isdigit()
                      and not p.name.endswith("-profile")), reverse=True)
    return next((p for p in folders if results.holds_results(p)), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path, help="result JSON files or run folders")
    p.add_argument("--baseline", action="append", type=Path, default=[], metavar="PATH",
                   help="a result file or run folder to compare with (repeat the flag for "
                        "several)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="HTML file (default: report.html in the first run folder given)")
    p.add_argument("--screenshot", type=Path, default=None, metavar="PNG",
                   help="also save a screenshot of the report's top (headless Chromium; a .png "
                        "path, checked before the report is built)")
    args = p.parse_args(argv)
    paths = args.paths
    if not paths:
        # Run folders are <YYYYmmdd-HHMMSS>-<device>; results/runs/host/ holds host-path runs.
        try:
            newest = newest_run_folder(ROOT / "results" / "runs")
        except results.ResultFileError as e:
            raise SystemExit(f"error: {e}") from None
        if newest is None:
            raise SystemExit("no result paths given and no run folder with result files under "
                             "results/runs/; run python -m bench first or pass result files")
        print(f"reporting the newest run folder: {newest}")
        paths = [newest]
    missing = [str(q) for q in [*paths, *args.baseline] if not q.exists()]
    if missing:
        raise SystemExit(f"no such result file or folder: {', '.join(missing)}")
    out = _writable_page(args.output or (
        (paths[0] if paths[0].is_dir() else paths[0].parent) / "report.html"))
    if args.screenshot:
        _usable_screenshot(args.screenshot)
    try:
        write_report(paths, args.baseline, out, need_rows=True)
    except results.ResultFileError as e:
        raise SystemExit(f"error: {e}") from None
    except UnwritablePage as e:
        raise SystemExit(str(e)) from None
    print(f"report: {out}")
    if args.screenshot:
        screenshot(out, args.screenshot)
        print(f"screenshot: {args.screenshot}")
    return 0


def screenshot(page: Path, png: Path, size: str = "1400,2400") -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("--screenshot needs chromium (Debian: apt-get install -y chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", f"--user-data-dir={profile}",
                        "--virtual-time-budget=15000", f"--window-size={size}",
                        f"--screenshot={png.resolve()}", page.resolve().as_uri()],
                       check=True, capture_output=True, timeout=180)
    if not png.is_file():  # chromium exits 0 when it could not write the file
        raise SystemExit(f"--screenshot {png}: chromium wrote no file (is the folder "
                         "writable?)")


if __name__ == "__main__":
    sys.exit(main())
