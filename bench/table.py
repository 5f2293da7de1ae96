"""Plain-text tables for the terminal (the JSON holds every field). Columns are sized from
their contents, so figures never run together."""

from __future__ import annotations


def fmt(v, spec: str = ".1f") -> str:
    """A figure formatted by ``spec``; "-" for none; text as it is (a hand-edited file)."""
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def render(headers: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    """Columns separated by two spaces; columns from ``right_from`` on are right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i >= right_from else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths),
                      *(line(r) for r in rows)])


def _med(row: dict | None):
    return None if row is None or not row.get("stats") else row["stats"]["median_us"]


def kernel_table(rows: list[dict]) -> str:
    return render(*kernel_cells(rows))


def kernel_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["verification"]["status"] == "failed":
            continue
        setup = " ".join(str(r[k]) for k in ("device", "preset", "dtype") if r.get(k))
        key = (setup, r["module"], r["tokens"], r["adapters"], r["rank"])
        by_case.setdefault(key, {})[r["provider"]] = r
    several = len({k[0] for k in by_case}) > 1  # name the set-up only where rows differ
    out = []
    for (setup, m, t, a, rk), p in by_case.items():
        tri = p.get("triton", {})
        d = tri.get("derived", {})
        out.append([*([setup] if several else []),
                    m, str(t), str(a), str(rk), fmt(_med(tri)), fmt(d.get("x_floor"), ".3g"),
                    fmt(d.get("achieved_gbps"), ".0f"), fmt(_med(p.get("triton_shrink"))),
                    fmt(_med(p.get("triton_expand"))), fmt(_med(p.get("torch"))),
                    fmt(_med(p.get("base"))), pct(d.get("pct_of_base")),
                    _added(p.get("module")), _added(p.get("module_serial")),
                    f"{fmt(_med(p.get('base_eager')))} / {fmt(_med(p.get('module_eager')))}",
                    _added(p.get("module_eager"))])
    return ([*(["set-up"] if several else []), "module", "T", "adapters", "r", "LoRA us",
             "x floor", "GB/s", "shrink us", "expand us", "torch ref us", "base GEMM us",
             "LoRA % of base", "module: LoRA adds", "one stream: adds",
             "eager us: GEMM / module", "eager: LoRA adds"], out)


def _added(row: dict | None) -> str:
    """A module row's ``lora_added_pct`` (what LoRA adds to the GEMM: in one graph, or eager
    against the eager GEMM)."""
    return pct(None if not row else row.get("derived", {}).get("lora_added_pct"))


def pct(value) -> str:
    return "-" if value is None else fmt(value, ".3g") + "%"


MODEL_HEADERS = ["model", "bs", "adapters", "r", "eager, no LoRA", "graph step, no-LoRA runtime",
                 "graph step, LoRA runtime, base traffic", "graph step, LoRA traffic",
                 "replay only: base / LoRA", "LoRA cost: step / replay only / bytes floor",
                 "paired, LoRA / base traffic: step / replay", "host us: LoRA / base traffic",
                 "graph speed-up, LoRA traffic", "eager: LoRA / base traffic"]


def model_table(rows: list[dict]) -> str:
    return render(*model_cells(rows))


def model_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per LoRA runtime and batch size, next to the runtime without LoRA of the same
    model, backend and batch size (microseconds)."""
    ok = [r for r in rows if r.get("stats")]
    cell, eager_ratio, floor, derived = {}, {}, {}, {}
    for r in ok:
        base = (r["step"], r["preset"], r["layers"], r["context"], r["batch_size"], r["dtype"],
                r.get("backend"))
        cell[(base, r["adapters"], r["ranks"], r["traffic"], r["path"])] = _med(r)
        derived[(base, r["adapters"], r["ranks"], r["traffic"], r["path"])] = r.get("derived", {})
        if r["traffic"] == "lora" and r["path"] == "replay_only":
            floor[(base, r["adapters"], r["ranks"])] = r.get("derived", {}).get("lora_floor_us")
        ratio = r.get("derived", {}).get("eager_lora_over_base")
        if ratio is not None:
            eager_ratio[(base, r["adapters"], r["ranks"])] = ratio
    out, bases = [], {k[0] for k in cell}
    ctx_varies, dtype_varies, backend_varies = (len({b[i] for b in bases}) > 1
                                                for i in (3, 5, 6))
    lora_lines = dict.fromkeys(k[:3] for k in cell if k[1] and k[3] == "lora" and k[4] == "graph")
    with_lora = {line[0] for line in lora_lines}
    # A runtime without LoRA whose model and batch size have no LoRA line (a selection of
    # no-LoRA cases) gets a line of its own: its rows were timed but the table was empty.
    lines = [*lora_lines,
             *dict.fromkeys((k[0], 0, "") for k in cell if not k[1] and k[0] not in with_lora)]
    for (base, adapters, ranks) in lines:
        step, preset, layers, context, bs, dtype, backend = base

        def nl(p, base=base):
            return cell.get((base, 0, "", "base", p))

        def lo(t, p, base=base, adapters=adapters, ranks=ranks):  # the LoRA runtime's
            return cell.get((base, adapters, ranks, t, p)) if adapters else None

        def got(t, p, field, base=base, adapters=adapters, ranks=ranks):
            return (derived.get((base, adapters, ranks, t, p), {}).get(field) if adapters
                    else None)

        step_cost = _pct(lo("lora", "graph"), nl("graph"))
        replay_cost = _pct(lo("lora", "replay_only"), nl("replay_only"))
        floor_us = floor.get((base, adapters, ranks))
        floor_cost = (100 * floor_us / nl("replay_only")
                      if floor_us is not None and nl("replay_only") else None)
        gain = (lo("lora", "eager") / lo("lora", "graph")
                if lo("lora", "eager") and lo("lora", "graph") else None)
        model = (f"{preset} ({layers} layers" + (f", ctx {context}" if ctx_varies else "")
                 + (f", {dtype}" if dtype_varies else "")
                 + (f", {backend}" if backend_varies else "")
                 + f"{'' if step == 'decode' else ', ' + step})")
        out.append([model, str(bs), str(adapters), ranks or "-",
                    fmt(nl("eager"), ".0f"), fmt(nl("graph"), ".0f"),
                    fmt(lo("base", "graph"), ".0f"), fmt(lo("lora", "graph"), ".0f"),
                    f"{fmt(nl('replay_only'), '.0f')} / {fmt(lo('lora', 'replay_only'), '.0f')}",
                    f"{fmt(step_cost)}% / {fmt(replay_cost)}% / {fmt(floor_cost)}%",
                    f"{_ratio(got('lora', 'graph', 'lora_over_base_traffic'), '.3f')} / "
                    f"{_ratio(got('lora', 'replay_only', 'lora_over_base_traffic'), '.3f')}",
                    f"{fmt(got('lora', 'graph', 'host_us'), '.0f')} / "
                    f"{fmt(got('base', 'graph', 'host_us'), '.0f')}",
                    "-" if gain is None else f"{gain:.1f}x",
                    _ratio(eager_ratio.get((base, adapters, ranks)))])
    return MODEL_HEADERS, out


def _ratio(x, spec=".2f"):
    return "-" if x is None else f"{x:{spec}}x"


def _pct(x, base):
    return 100 * (x / base - 1) if x and base else None


def failures(rows: list[dict]) -> str:
    bad = [r for r in rows if r["verification"]["status"] == "failed"]
    return "\n".join(f"FAILED {r['label']}: {r['verification']['error']}\n  reproduce: "
                     f"{r['reproduce']}" for r in bad)
