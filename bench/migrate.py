"""Reads result files of older schemas as the current one (in memory; the files on disk are
rewritten only when a run upserts into them).

Schema 2 DP rows of before the workload was part of a DP case's key get it
(``_dp_workload_keyed``).

Schema 1 (before the case dataclasses): flat rows with the stats at the top level, keyed by
hand-written tuples; model rows had a ``runtime`` field and ``kind: capture`` rows; kernel
cases were checked against fp32 (a failure stopped the run), model cases were not verified.
"""

from __future__ import annotations

from bench.scenarios import DP_WORKLOAD, dp_workload_suffix

STATS = ("median_us", "p20_us", "p80_us")
KERNEL_DERIVED = ("regime", "copies", "floor_bytes", "floor_flops", "floor_us", "x_floor",
                  "achieved_gbps", "base_us", "pct_of_base")
MODEL_DERIVED = ("graph_kind", "tokens_per_s", "weight_bytes", "floor_us", "x_floor")
PRESET_OF_PROFILE = {"gpu": "llama3-8b", "gpu-quick": "llama3-8b", "cpu": "tiny"}


class NotAResultFile(ValueError):
    """JSON that is not a benchmark result file (pytest-benchmark output, a profiler trace)."""


class MalformedResultFile(ValueError):
    """A result file whose structure is broken (hand-edited, or written by a broken tool)."""


class NewerResultFile(ValueError):
    """A result file of a schema this checkout does not know (written by a newer one)."""


def to_current(data: dict) -> dict:
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        keys = sorted(data)[:4] if isinstance(data, dict) else type(data).__name__
        raise NotAResultFile(f"not a benchmark result file (no 'rows' list; found {keys})")
    schema = data.get("schema", 1)
    if type(schema) is not int:
        raise MalformedResultFile(f"'schema' is {schema!r}, not an integer")
    if not isinstance(data.get("runs", {}), dict) or not all(
            isinstance(v, dict) for v in data.get("runs", {}).values()):
        raise MalformedResultFile("'runs' is not an object of run records")
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            raise MalformedResultFile(f"row {i} is {type(r).__name__}, not an object")
    if schema > 2:
        raise NewerResultFile(f"its schema {schema} is newer than this checkout reads (2): "
                              "report it with the checkout that wrote it")
    if schema == 2:
        _check_current(data)
        return _dp_workload_keyed(data)
    runs = {k: v | {"run_id": v.get("run_id", k)} for k, v in data.get("runs", {}).items()}
    lora_adapters = {}
    for i, r in enumerate(data["rows"]):
        if r.get("kind") == "decode_step" and _field(r, "traffic", i) == "lora":
            key = tuple(_field(r, k, i) for k in ("run_id", "preset", "layers", "batch_size"))
            lora_adapters[key] = _field(r, "adapters", i)
    rows = []
    for i, r in enumerate(data["rows"]):
        profile = runs.get(r.get("run_id"), {}).get("profile", "gpu")
        try:
            if r.get("suite") == "kernels":
                rows.append(_kernel_row(r, profile))
            elif r.get("kind") == "decode_step":
                rows.append(_model_row(r, lora_adapters))
        except KeyError as e:
            raise MalformedResultFile(f"row {i} of schema 1 has no {e.args[0]!r}") from None
    return {"schema": 2, "runs": runs, "rows": rows}


def _field(r: dict, key: str, i: int):
    if key not in r:
        raise MalformedResultFile(f"row {i} of schema 1 has no {key!r}")
    return r[key]


def _common(r: dict, case: dict, variant: dict, derived: tuple, verification: dict) -> dict:
    return {
        "schema": 2, "suite": r["suite"], "run_id": r.get("run_id"),
        "reproduce": r.get("reproduce", ""), **case, "case_key": sorted(case),
        **variant, "variant": sorted(variant),
        # A row without a median was not timed: null stats, as readers of schema 2 expect.
        "stats": {**{k: r.get(k) for k in STATS}, "n": r.get("samples"),
                  "mode": r.get("timing_mode")} if _number(r.get("median_us")) else None,
        "samples_us": [], "derived": {k: r.get(k) for k in derived if k in r},
        "telemetry": None, "verification": verification,
    }


def _kernel_row(r: dict, profile: str) -> dict:
    case = {"preset": PRESET_OF_PROFILE.get(profile, "llama3-8b"), "module": r["module"],
            "tokens": r["tokens"], "adapters": r["adapters"], "rank": r["rank"],
            "dtype": r["dtype"]}
    label = f"kernels {r['module']} T={r['tokens']} adapters={r['adapters']} r={r['rank']}"
    ver = {"status": "verified", "error": None, "max_rel_err": r.get("max_rel_err")}
    return _common(r, case, {"provider": r["provider"]}, KERNEL_DERIVED, ver) | {"label": label}


def _model_row(r: dict, lora_adapters: dict) -> dict:
    lora = r["runtime"] == "lora"
    adapters = lora_adapters.get((r.get("run_id"), r["preset"], r["layers"], r["batch_size"]), 0)
    case = {"step": "decode", "preset": r["preset"], "layers": r["layers"],
            "context": r["context"], "batch_size": r["batch_size"],
            "adapters": adapters if lora else 0, "ranks": str(r["rank"]) if lora else "",
            "backend": r["backend"], "dtype": r["dtype"]}
    rt = f"adapters={adapters} r={r['rank']}" if lora else "no-lora"
    label = (f"model decode {r['preset']} L={r['layers']} ctx={r['context']} "
             f"bs={r['batch_size']} {rt}")
    ver = {"status": "unverified", "error": None}
    return (_common(r, case, {"traffic": r["traffic"], "path": r["path"]}, MODEL_DERIVED, ver)
            | {"label": label})


def _dp_workload_keyed(data: dict) -> dict:
    """DP rows written before their workload was part of their key get it: the workload their
    run recorded (``derived.workload``; a skipped row, which ran nothing, takes a row's of its
    run) and ``overlap`` as ``derived.overlap`` recorded it (absent: before 6a1e698 the DP
    engine served serially); null where no row of the run recorded one (a key that no new row
    matches)."""
    def old(r):
        return r["suite"] == "dp" and "overlap" not in r["case_key"]

    of_run = {}
    for r in filter(old, data["rows"]):
        if _recorded_workload(r):
            of_run.setdefault(r["run_id"], _recorded_workload(r))
    unknown = dict.fromkeys((*DP_WORKLOAD, "overlap"))

    def keyed(r):
        w = _recorded_workload(r) or of_run.get(r["run_id"], unknown)
        label = r["label"] + dp_workload_suffix({k: v for k, v in w.items() if v is not None})
        return r | w | {"case_key": sorted({*r["case_key"], *w}), "label": label}

    return data | {"rows": [keyed(r) if old(r) else r for r in data["rows"]]}


def _recorded_workload(r: dict) -> dict | None:
    w = r["derived"].get("workload")
    if not isinstance(w, dict) or not all(_number(w.get(k)) for k in DP_WORKLOAD):
        return None
    return {k: w[k] for k in DP_WORKLOAD} | {"overlap": r["derived"].get("overlap") is True}


def _check_current(data: dict) -> None:
    """The fields every reader of a schema-2 file relies on."""
    if not isinstance(data.get("runs"), dict):
        raise MalformedResultFile("no 'runs' object")
    for run_id, run in data["runs"].items():
        _check_run(run_id, run)
    for i, r in enumerate(data["rows"]):
        missing = [k for k in ("suite", "label", "case_key", "variant", "verification",
                               "run_id") if k not in r]
        if missing:
            raise MalformedResultFile(f"row {i} has no {', '.join(missing)}")
        for k in ("suite", "run_id"):
            if not isinstance(r[k], str):
                raise MalformedResultFile(f"row {i}: {k!r} is not text (got {r[k]!r})")
        if not isinstance(r["case_key"], list) or not isinstance(r["variant"], list):
            raise MalformedResultFile(f"row {i}: 'case_key' and 'variant' must be lists")
        named = r["case_key"] + r["variant"]
        if not all(isinstance(k, str) for k in named):
            raise MalformedResultFile(f"row {i}: 'case_key' and 'variant' must list field "
                                      f"names (text), got {named!r}")
        # Rows are matched by these fields' values: each must be one value, not a list.
        bad = [k for k in named if k in r and not _scalar(r[k])]
        if bad:
            raise MalformedResultFile(f"row {i}: its case field {bad[0]!r} holds "
                                      f"{r[bad[0]]!r}; a case field holds one value")
        if not isinstance(r["verification"], dict) or not isinstance(
                r["verification"].get("status"), str):
            raise MalformedResultFile(f"row {i}: 'verification' has no 'status' text")
        if r.get("stats") is not None and not isinstance(r["stats"], dict):
            raise MalformedResultFile(f"row {i}: 'stats' is neither an object nor null")
        if r.get("stats") and not _number(r["stats"].get("median_us")):
            raise MalformedResultFile(f"row {i}: 'stats' has no numeric 'median_us' (a row "
                                      "not timed has \"stats\": null)")
        if not isinstance(r.get("derived"), dict):
            raise MalformedResultFile(f"row {i}: 'derived' is not an object ({{}} when the "
                                      "row has no figures)")
        for k, v in r["derived"].items():
            if _computed_with(k) and v is not None and not _number(v):
                raise MalformedResultFile(f"row {i}: its figure 'derived.{k}' holds {v!r}; "
                                          "the report computes with it: a number or null")
        for part in ("case_key", "variant"):  # the tables index rows by these
            lost = [k for k in r[part] if k not in r]
            if lost:
                raise MalformedResultFile(f"row {i}: its {part} names {lost[0]!r} but the row "
                                          "has no such field")


def _check_run(run_id, run) -> None:
    """The run record's fields that the report reads as objects or numbers."""
    if not isinstance(run, dict):
        raise MalformedResultFile(f"run {run_id!r} is not an object")
    if run.get("ceilings") is not None and not isinstance(run["ceilings"], dict):
        raise MalformedResultFile(f"run {run_id!r}: 'ceilings' is not an object "
                                  f"(got {run['ceilings']!r})")
    v = run.get("suite_seconds")
    if v is not None and not (isinstance(v, dict) and all(
            x is None or _number(x) for x in v.values())):
        raise MalformedResultFile(f"run {run_id!r}: 'suite_seconds' must map suites to "
                                  f"seconds (got {v!r})")
    for k in ("device", "git_sha", "profiled_by"):
        if run.get(k) is not None and not isinstance(run[k], str):
            raise MalformedResultFile(f"run {run_id!r}: {k!r} is not text (got {run[k]!r})")


FIGURES = frozenset({"x_floor", "achieved_gbps", "pct_of_base", "lora_added_pct",
                     "lora_floor_us", "eager_lora_over_base", "lora_over_base_traffic",
                     "host_us", "output_tokens_per_s", "idle_share", "pct_of_roofline"})
"""Derived fields the report and its tables compute with (and ``idle_forward_*_us``)."""


def _computed_with(field: str) -> bool:
    return field in FIGURES or (field.startswith("idle_forward_") and field.endswith("_us"))


def _scalar(x) -> bool:
    return x is None or isinstance(x, (str, int, float, bool))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
