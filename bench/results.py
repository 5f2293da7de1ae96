"""Result files and rows.

A file: ``{"schema": 2, "runs": {run_id: provenance}, "rows": [...]}``, one per suite and
device (``<suite>-<device>.json``). Rows are written as each case finishes (an interrupted
run keeps what it finished) and upserted by case: a re-run of a case replaces its rows only.

A row (schema 2)::

    schema, suite, label, reproduce, run_id
    <the case's fields>        the key, listed in "case_key" (derived from the case dataclass)
    <variant fields>           e.g. provider, or traffic + path; listed in "variant"
    stats                      {median_us, p20_us, p80_us, mean_us, min_us, max_us, n, mode}
                               (null when the case was not timed)
    samples_us                 the raw per-call samples
    derived                    figures judged against the hardware (x_floor, pct_of_base, ...)
    telemetry                  bench.telemetry record of the case, or null
    verification               {"status": "verified" | "failed" | "skipped" | "unverified",
                                "error", ...} (skipped: the error says why it did not run)

Files of schema 1 (flat stats, no verification) are migrated when read (``bench.migrate``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import migrate
from bench.case import Case

SCHEMA = 2


def make_row(case: Case, profile: str, variant: dict, *, timing=None, derived=None,
             telemetry=None, verification=None) -> dict:
    if (verification or {}).get("status") == "failed":
        # Never published, charted or compared as if good: a failed case carries no timing.
        timing, derived = None, None
    return {
        "schema": SCHEMA, "suite": case.suite, "label": case.label,
        "reproduce": case.reproduce(profile), **case.key(), "case_key": sorted(case.key()),
        **variant, "variant": sorted(variant),
        "stats": None if timing is None else timing.stats(),
        "samples_us": [] if timing is None else list(timing.samples_us),
        "derived": derived or {}, "telemetry": telemetry or None,
        "verification": verification or {"status": "unverified"},
    }


def case_id(row: dict) -> tuple:
    return (row["suite"], *((k, row.get(k)) for k in row["case_key"]))


def row_id(row: dict) -> tuple:
    return (*case_id(row), *((k, row.get(k)) for k in row["variant"]))


class ResultFileError(ValueError):
    """A result file that cannot be read; the message names the file and what is wrong."""


class NotAResultFile(ResultFileError):
    """A JSON file that is not a result file (pytest-benchmark output, a profiler trace)."""


def load(path: Path) -> dict:
    """A result file, migrated to the current schema in memory."""
    path = Path(path)
    if path.suffix != ".json":
        raise ResultFileError(f"{path}: not a result file (result files are the suites' "
                              "*.json files, or pass the run folder holding them)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8 (RFC 8259)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        what = (f"{e.msg} at line {e.lineno} column {e.colno}"
                if isinstance(e, json.JSONDecodeError) else str(e))
        raise ResultFileError(f"{path}: not valid JSON ({what}); the file is truncated or "
                              "corrupt: restore it or delete it and re-run its suite") from None
    try:
        data = migrate.to_current(data)
    except migrate.NotAResultFile as e:
        raise NotAResultFile(f"{path}: {e}") from None
    except migrate.NewerResultFile as e:
        raise ResultFileError(f"{path}: {e}") from None
    except migrate.MalformedResultFile as e:
        raise ResultFileError(f"{path}: {e}; restore the file or delete it and re-run its "
                              "suite") from None
    return data


def upsert(path: Path, run: dict, rows: list[dict]) -> dict:
    """Write ``rows`` (all of one or more cases) into ``path``, replacing those cases' rows
    of the same device (``run["device"]``: another device's rows stay); a case skipped here
    (a DP size above this machine's GPUs) keeps the rows of a run that ran it, where a
    skipped row had replaced them (published results of a larger machine)."""
    data = load(path) if path.exists() else {"schema": SCHEMA, "runs": {}, "rows": []}
    # Rows of another device are never replaced: a file the user names (dp_bench --out)
    # may gather runs of several machines, as the report reads them.
    device, runs = run.get("device"), data["runs"]

    def here(r: dict) -> bool:
        return runs.get(r["run_id"], {}).get("device") == device

    ran = {case_id(r) for r in data["rows"]
           if r["verification"]["status"] != "skipped" and here(r)}
    rows = [r for r in rows
            if r["verification"]["status"] != "skipped" or case_id(r) not in ran]
    fresh = {case_id(r) for r in rows}
    kept = [r for r in data["rows"] if case_id(r) not in fresh or not here(r)]
    run_id = run["run_id"]
    data["runs"][run_id] = run
    data["rows"] = kept + [r | {"run_id": run_id} for r in rows]
    live = {r["run_id"] for r in data["rows"]}
    data["runs"] = {k: v for k, v in data["runs"].items() if k in live}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # an interrupt mid-write leaves the previous file whole
    return data


def holds_results(folder: Path) -> bool:
    """Whether ``folder`` has a result file (a profile run's folder may hold a trace only)."""
    for f in sorted(Path(folder).glob("*.json")):
        try:
            load(f)
            return True
        except NotAResultFile:
            pass
    return False


def rows_of(paths: list[Path], note=None) -> tuple[list[dict], dict]:
    """Rows and runs of result files or run folders (every ``*.json`` in a folder). A folder's
    JSON files that are not result files are skipped with a note (``note``, default: a line
    on stderr); a file named explicitly must be a result file. A file read twice (a folder and
    a file in it) and a row found in two files (a run folder and the results it published)
    count once."""
    rows, runs, skipped, seen_files, seen_rows = [], {}, [], set(), set()
    for p in paths:
        files = sorted(Path(p).glob("*.json")) if Path(p).is_dir() else [Path(p)]
        for f in files:
            if f.resolve() in seen_files:
                continue
            seen_files.add(f.resolve())
            try:
                data = load(f)
            except NotAResultFile:
                if not Path(p).is_dir():
                    raise
                skipped.append(str(f))
                continue
            for r in data["rows"]:
                if (r.get("run_id"), row_id(r)) not in seen_rows:
                    seen_rows.add((r.get("run_id"), row_id(r)))
                    rows.append(r)
            for rid, run in data["runs"].items():
                # One run writes one file per suite, each recording the suites done so far:
                # keep every suite's seconds whichever file is read last.
                seconds = {**(runs.get(rid, {}).get("suite_seconds") or {}),
                           **(run.get("suite_seconds") or {})}  # null: none recorded
                runs[rid] = run | ({"suite_seconds": seconds} if seconds else {})
    if skipped:
        (note or _stderr)(f"skipped {len(skipped)} JSON files that are not result files: "
                          + ", ".join(skipped))
    return rows, runs


def latest_per_case(rows: list[dict], runs: dict) -> tuple[list[dict], int]:
    """Of rows of the same case on the same device from several runs, the latest run's
    (run ids start with the run's UTC time), and how many rows that superseded. A run timed
    under a profiler (``profiled_by``) never supersedes one that was not, and a case skipped
    by a run (a DP size above its GPUs) never supersedes a run that ran it, as in ``upsert``
    (a later 2-GPU run hid an 8-GPU run's DP 4 and 8 rows)."""
    def key(r):
        return runs.get(r.get("run_id"), {}).get("device"), case_id(r)

    def rank(r):
        run_id = r.get("run_id") or ""
        return (r["verification"]["status"] != "skipped",
                not runs.get(run_id, {}).get("profiled_by"), run_id)

    latest: dict[tuple, tuple] = {}
    for r in rows:
        latest[key(r)] = max(latest.get(key(r), (False, False, "")), rank(r))
    kept = [r for r in rows if rank(r) == latest[key(r)]]
    return kept, len(rows) - len(kept)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
