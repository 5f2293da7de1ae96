"""Plain-text tables for the terminal (the JSON holds every field)."""

from __future__ import annotations


def _fmt(v, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-' if v is None else format(v, '.' + spec.split('.')[1]):>{width}}"


def kernel_table(rows: list[dict]) -> str:
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["module"], r["tokens"], r["adapters"], r["rank"])
        by_case.setdefault(key, {})[r["provider"]] = r
    head = (f"{'module':<13}{'T':>6}{'ad':>4}{'r':>4} | {'lora us':>9}{'x floor':>9}{'GB/s':>7}"
            f" | {'shrink':>8}{'expand':>8} | {'torch us':>9} | {'base us':>9}{'% base':>10}")
    out = [head, "-" * len(head)]
    for (m, t, a, r), p in by_case.items():
        tri, base = p.get("triton", {}), p.get("base", {})
        out.append(
            f"{m:<13}{t:>6}{a:>4}{r:>4} | {_fmt(tri.get('median_us'), '9.1f')}"
            f"{_fmt(tri.get('x_floor'), '9.3g')}{_fmt(tri.get('achieved_gbps'), '7.0f')}"
            f" | {_fmt(p.get('triton_shrink', {}).get('median_us'), '8.1f')}"
            f"{_fmt(p.get('triton_expand', {}).get('median_us'), '8.1f')}"
            f" | {_fmt(p.get('torch', {}).get('median_us'), '9.1f')}"
            f" | {_fmt(base.get('median_us'), '9.1f')}{_fmt(tri.get('pct_of_base'), '9.3g')}%"
        )
    return "\n".join(out)
