"""The report's charts: each function takes result rows and returns plotly figures (an empty
list when the rows it draws are absent; the report then shows a placeholder)."""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

LAYOUT = dict(template="plotly_white", height=380, margin=dict(l=60, r=20, t=50, b=50),
              legend=dict(font=dict(size=10)))


def _num(x) -> bool:
    """A figure a chart can draw (a hand-edited file may hold text where a number belongs)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _med(r: dict):
    return r["stats"]["median_us"] if r.get("stats") else None


def _fig(title: str, x: str, y: str, log_x=False, log_y=False) -> go.Figure:
    f = go.Figure()
    f.update_layout(title=title, xaxis_title=x, yaxis_title=y, **LAYOUT)
    if log_x:
        f.update_xaxes(type="log")
    if log_y:
        f.update_yaxes(type="log")
    return f


def _setup(rows, fields: tuple[str, ...], group=lambda r: None):
    """``row -> str`` naming those of ``fields`` whose values differ among rows of one
    ``group`` (runs of other layer counts, presets or contexts must never share a bar or a
    line; a field that only tells groups apart is already in their name)."""
    values = defaultdict(set)
    for r in rows:
        for f in fields:
            values[(group(r), f)].add(r.get(f))
    varying = [f for f in fields if any(len(values[(g, f)]) > 1 for g in map(group, rows))]
    return lambda r: "".join(f" {f}={r.get(f)}" for f in varying)


def _lines(fig: go.Figure, series: dict, sort=True) -> go.Figure:
    for name, pts in series.items():
        pts = sorted(pts) if sort else pts
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts],
                                 mode="lines+markers", name=str(name)))
    return fig


def _kernel_by_module(rows, field: str, title: str, y: str, log_y=False,
                      provider="triton") -> list[go.Figure]:
    tri = [r for r in rows if r["suite"] == "kernels" and r.get("provider") == provider
           and r.get("stats")]
    def setup(r):
        return r.get("preset"), r.get("dtype")

    several = len({setup(r) for r in tri}) > 1  # named in the title only where rows differ
    figs = []
    for module, su in dict.fromkeys((r["module"], setup(r)) for r in tri):
        series = defaultdict(list)
        for r in tri:
            if (r["module"], setup(r)) == (module, su) and _num(r["derived"].get(field)):
                series[(r["adapters"], r["rank"])].append((r["tokens"], r["derived"][field]))
        named = {f"adapters={a} r={rk}": pts for (a, rk), pts in sorted(series.items())}
        name = f"{module} {su[0]} {su[1]}" if several else module
        figs.append(_lines(_fig(f"{title}: {name}", "tokens (T)", y, log_x=True,
                                log_y=log_y), named))
    return figs


def kernel_pct_of_base(rows) -> list[go.Figure]:
    return _kernel_by_module(rows, "pct_of_base", "LoRA time as % of the base GEMM",
                             "LoRA % of base", log_y=True)


def kernel_added_to_module(rows) -> list[go.Figure]:
    return _kernel_by_module(rows, "lora_added_pct",
                             "What LoRA adds to the module in a graph (shrink beside the GEMM)",
                             "LoRA adds, % of base", provider="module")


def kernel_x_floor(rows) -> list[go.Figure]:
    return _kernel_by_module(rows, "x_floor", "LoRA time over its bytes/FLOP floor", "x floor",
                             log_y=True)


def _model_cells(rows, field=None):
    """Model-suite medians (or ``derived[field]``) keyed by (base, bs, adapters, ranks,
    traffic, path); ``base`` names the step and backend too (a decode and a prefill of equal
    context and batch size are different cases, and so are triton and torch rows)."""
    cell = {}
    for r in rows:
        if r["suite"] == "model" and r.get("stats"):
            base = (r["preset"], r["layers"], r["context"], r["dtype"], r["step"],
                    r.get("backend"))
            cell[(base, r["batch_size"], r["adapters"], r["ranks"], r["traffic"],
                  r["path"])] = _med(r) if field is None else r["derived"].get(field)
    return cell


def _model_namer(cell):
    """Names of the model cells' set-ups: preset and layers, the step where not decode, and
    the context, dtype and backend where the rows differ in them."""
    bases = {k[0] for k in cell}
    ctx, dt, be = (len({b[i] for b in bases}) > 1 for i in (2, 3, 5))

    def name(base) -> str:
        preset, layers, context, dtype, step, backend = base
        return (f"{preset} L={layers}" + (f" ctx={context}" if ctx else "")
                + (f" {dtype}" if dt else "") + (f" {backend}" if be else "")
                + ("" if step == "decode" else f" {step}"))
    return name


def model_graph_vs_eager(rows) -> list[go.Figure]:
    cell = _model_cells(rows)
    model_name, figs = _model_namer(cell), {}
    for (base, bs, a, rk, traffic, path), eager in cell.items():
        graph = cell.get((base, bs, a, rk, traffic, "graph"))
        if path != "eager" or not graph:
            continue
        name = model_name(base)
        fig = figs.setdefault(name, (_fig(f"Graph speed-up over eager (eager / graph step): "
                                          f"{name}", "batch size", "speed-up (x)",
                                          log_x=True), defaultdict(list)))
        rt = "no-LoRA runtime" if not a else f"adapters={a} r={rk}, {traffic} traffic"
        fig[1][rt].append((bs, eager / graph))
    return [_lines(f, dict(sorted(s.items()))) for f, s in figs.values()]


def model_lora_cost(rows) -> list[go.Figure]:
    """LoRA's cost over the runtime without LoRA, and beside it LoRA's bytes floor (its
    adapters read once at the copy rate) over the same replay: the least LoRA can add."""
    cell, floor = _model_cells(rows), _model_cells(rows, "lora_floor_us")
    model_name, figs = _model_namer(cell), {}
    for (base, bs, a, rk, traffic, path), t in cell.items():
        ref = cell.get((base, bs, 0, "", "base", path))
        if not a or path not in ("graph", "replay_only") or not ref:
            continue
        name = model_name(base)
        fig = figs.setdefault(name, (_fig(f"LoRA cost over the runtime without LoRA: {name}",
                                          "batch size", "% over no-LoRA", log_x=True),
                                     defaultdict(list)))
        fig[1][f"adapters={a} r={rk} {traffic} traffic, {path}"].append(
            (bs, 100 * (t / ref - 1)))
        least = floor.get((base, bs, a, rk, traffic, path))
        if path == "replay_only" and _num(least):
            fig[1][f"adapters={a} r={rk}, LoRA's bytes floor"].append((bs, 100 * least / ref))
    return [_lines(f, dict(sorted(s.items()))) for f, s in figs.values()]


def throughput(rows) -> list[go.Figure]:
    tp = [r for r in rows if r["suite"] == "throughput"
          and _num(r["derived"].get("output_tokens_per_s"))]
    figs, setup = [], _setup(tp, ("layers", "dtype", "requests"))
    for wl in dict.fromkeys((r["preset"], r["workload"] + setup(r)) for r in tp):
        mine = [r for r in tp if (r["preset"], r["workload"] + setup(r)) == wl]
        series = defaultdict(list)
        for r in mine:
            if r["adapters"]:
                series[f"{r['popularity']} r={r['ranks']}"].append(
                    (r["adapters"], r["derived"]["output_tokens_per_s"]))
        fig = _lines(_fig(f"Output tokens/s vs adapters: {wl[0]} {wl[1]}", "adapters",
                          "output tokens/s", log_x=True), dict(sorted(series.items())))
        for r in mine:
            if not r["adapters"]:
                fig.add_hline(y=r["derived"]["output_tokens_per_s"], line_dash="dot",
                              annotation_text="base model, no LoRA")
        figs.append(fig)
    return figs


def idle(rows) -> list[go.Figure]:
    idl = [r for r in rows if r["suite"] == "idle" and r.get("stats")]
    if not idl:
        return []
    fig = _fig("Idle path: forward time, LoRA runtime vs runtime without LoRA", "scenario",
               "median us")
    setup = _setup(idl, ("preset", "layers", "dtype", "context", "adapters", "rank"),
                   group=lambda r: r["scenario"])
    for runtime in ("no_lora", "lora"):
        for path in ("eager", "graph"):
            pts = [(f"{r['scenario']} bs={r['batch_size']}{setup(r)}", _med(r)) for r in idl
                   if r.get("runtime") == runtime and r.get("path") == path]
            if pts:
                fig.add_trace(go.Bar(x=[p[0] for p in pts], y=[p[1] for p in pts],
                                     name=f"{runtime}, {path}"))
    fig.update_layout(barmode="group")
    return [fig]


def dp(rows) -> list[go.Figure]:
    d = [r for r in rows if r["suite"] == "dp"
         and _num(r["derived"].get("output_tokens_per_s"))]
    if not d:
        return []
    series, idle_share, idle_us = defaultdict(list), defaultdict(list), defaultdict(list)
    setup = _setup(d, ("preset", "layers", "dtype", "requests_per_rank", "prompt", "output",
                       "max_batch", "overlap"))
    for r in d:
        lora = (f"adapters={r['adapters']} r={r['ranks']}" if r["adapters"] else "no LoRA"
                ) + setup(r)
        series[f"{r['load']}, {lora}"].append((r["dp_size"], r["derived"]["output_tokens_per_s"]))
        if _num(r["derived"].get("idle_share")):
            idle_share[f"{r['load']}, {lora}"].append((r["dp_size"],
                                                       100 * r["derived"]["idle_share"]))
        for variant in ("lora", "peers", "base") if r["adapters"] else ():
            us = r["derived"].get(f"idle_forward_{variant}_us")
            if _num(us):
                idle_us[f"{variant} variant, {r['load']}, {lora}"].append((r["dp_size"], us))
    figs = [_lines(_fig("DP scaling: output tokens/s vs DP size", "DP size", "output tokens/s"),
                   dict(sorted(series.items())))]
    if idle_share:
        figs.append(_lines(_fig("Share of rank time in idle forwards", "DP size", "% of time"),
                           dict(sorted(idle_share.items()))))
    if idle_us:
        figs.append(_lines(_fig("One idle forward per graph variant (LoRA runtime)", "DP size",
                                "us"), dict(sorted(idle_us.items()))))
    return figs


def deltas(pairs: list[tuple[str, float]]) -> list[go.Figure]:
    """``pairs``: (label, current / baseline) for rows present in both runs."""
    if not pairs:
        return []
    pairs = sorted(pairs, key=lambda p: -p[1])
    fig = _fig("Median time, this run over the baseline (above 1.1: slower)", "case", "ratio")
    fig.add_trace(go.Bar(x=[p[0] for p in pairs], y=[p[1] for p in pairs],
                         marker_color=["#c0392b" if v > 1.1 else "#27ae60" if v < 0.9
                                       else "#7f8c8d" for _, v in pairs]))
    fig.update_xaxes(showticklabels=len(pairs) <= 40)
    return [fig]


def base_step(rows) -> list[go.Figure]:
    steps = [r for r in rows if r["suite"] == "base_step" and r.get("stats")
             and _num(r["derived"].get("pct_of_roofline"))]
    if not steps:
        return []
    series, setup = defaultdict(list), _setup(steps, ("preset", "dtype"))
    for r in steps:
        series[f"L={r['layers']} ctx={r['context']} {r['kernels']}{setup(r)}"].append(
            (r["batch_size"], r["derived"]["pct_of_roofline"]))
    return [_lines(_fig("Base decode step: % of its roofline floor", "batch size",
                        "% of floor", log_x=True), dict(sorted(series.items())))]


def attention(rows) -> list[go.Figure]:
    att = [r for r in rows if r["suite"] == "attention" and r.get("stats")
           and not r.get("tiles") and _num(r["derived"].get("x_floor"))]
    if not att:
        return []
    series, setup = defaultdict(list), _setup(att, ("dtype", "heads", "kv_heads", "head_dim"))
    for r in att:
        prefix = f" prefix={r['prefix']}" if r.get("prefix") else ""
        series[f"{r['regime']} len={r['length']}{prefix} {r['provider']}{setup(r)}"].append(
            (r["requests"], r["derived"]["x_floor"]))
    return [_lines(_fig("Attention over the KV cache: time over its floor", "requests",
                        "x floor", log_x=True, log_y=True), dict(sorted(series.items())))]
