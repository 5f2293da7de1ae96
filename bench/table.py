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


def model_table(rows: list[dict]) -> str:
    steps = [r for r in rows if r["kind"] == "decode_step"]
    by_case: dict[tuple, dict[tuple, dict]] = {}
    for r in steps:
        key = (r["preset"], r["layers"], r["batch_size"])
        by_case.setdefault(key, {})[(r["runtime"], r["traffic"], r["path"])] = r
    cols = [("no_lora", "base"), ("lora", "base"), ("lora", "lora")]
    head = (f"{'model':<10}{'L':>3}{'bs':>5} |" + "".join(
        f" {rt + '/' + tr:>24} |" for rt, tr in cols)
        + f" {'LoRA cost':>9} {'graph gain':>10}")
    out = ["decode step, median us: eager / graph step / replay only", head, "-" * len(head)]
    for (preset, layers, bs), p in by_case.items():
        cells = []
        for rt, tr in cols:
            e = p.get((rt, tr, "eager"), {}).get("median_us")
            g = p.get((rt, tr, "graph"), {}).get("median_us")
            o = p.get((rt, tr, "replay_only"), {}).get("median_us")
            cells.append(f" {_fmt(e, '8.0f')}/{_fmt(g, '7.0f')}/{_fmt(o, '7.0f')} |")
        base_g = p.get(("no_lora", "base", "graph"), {}).get("median_us")
        lora_g = p.get(("lora", "lora", "graph"), {}).get("median_us")
        lora_e = p.get(("lora", "lora", "eager"), {}).get("median_us")
        cost = 100 * (lora_g / base_g - 1) if base_g and lora_g else None
        gain = lora_e / lora_g if lora_e and lora_g else None
        out.append(f"{preset:<10}{layers:>3}{bs:>5} |" + "".join(cells)
                   + f" {_fmt(cost, '8.1f')}% {_fmt(gain, '9.2f')}x")
    caps = [r for r in rows if r["kind"] == "capture"]
    for r in caps:
        out.append(f"capture {r['preset']} L={r['layers']} {r['runtime']}: {r['graphs']} graphs "
                   f"in {r['capture_seconds']:.2f} s, {r['graph_memory_bytes'] / 2**20:.1f} MiB")
    return "\n".join(out)
