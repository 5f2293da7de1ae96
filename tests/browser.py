"""Headless Chromium for report tests: loads an HTML file with two scripts added (one that
records page errors and console.error calls, one that counts the plotly charts that drew an
SVG) and returns what the page reported."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=15000"]

COLLECT_ERRORS = """<script>window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
(function () { const orig = console.error;
  console.error = function (...a) { window.__errors.push(a.join(' ')); orig.apply(console, a); };
})();</script>"""

COUNT_CHARTS = """<script>window.addEventListener('load', () => setTimeout(() => {
  const divs = [...document.querySelectorAll('.plotly-graph-div')];
  const drawn = divs.filter(d => d.querySelector('.main-svg')).length;
  document.body.setAttribute('data-charts', drawn + '/' + divs.length);
  document.body.setAttribute('data-errors', JSON.stringify(window.__errors));
}, 500));</script>"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(html_path: Path) -> tuple[int, int, list[str]]:
    """(charts drawn, chart divs, page errors)."""
    page = Path(html_path).read_text()
    page = page.replace("<head>", "<head>" + COLLECT_ERRORS, 1).replace(
        "</body>", COUNT_CHARTS + "</body>", 1)
    with tempfile.TemporaryDirectory(prefix="report-browser-") as tmp:
        target = Path(tmp) / "page.html"
        target.write_text(page)
        out = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp}/profile",
                              "--dump-dom", target.as_uri()],
                             capture_output=True, text=True, timeout=180)
    charts = re.search(r'data-charts="(\d+)/(\d+)"', out.stdout)
    errors = re.search(r'data-errors="([^"]*)"', out.stdout)
    if charts is None or errors is None:
        raise AssertionError(f"the page never finished loading (chromium rc={out.returncode}):"
                             f"\n{out.stderr[-2000:]}")
    errs = json.loads(errors.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    errs += [ln for ln in out.stderr.splitlines() if "Uncaught" in ln]
    return int(charts.group(1)), int(charts.group(2)), errs
