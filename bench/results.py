"""Result files: JSON with the runs that produced them and tidy rows, upserted by key, so a
re-run of one case replaces its row and leaves the others."""

from __future__ import annotations

import json
from pathlib import Path


def upsert(path: Path, run: dict, rows: list[dict], key: tuple[str, ...]) -> dict:
    data = {"runs": {}, "rows": []}
    if path.exists():
        data = json.loads(path.read_text())
    run_id = f"{run['timestamp']}-{run['git_sha'][:10]}"
    data["runs"][run_id] = run
    fresh = {tuple(r.get(k) for k in key) for r in rows}
    kept = [r for r in data["rows"] if tuple(r.get(k) for k in key) not in fresh]
    stamped = [r | {"run_id": run_id, "reproduce": run["command"]} for r in rows]
    data["rows"] = kept + stamped
    live = {r["run_id"] for r in data["rows"]}
    data["runs"] = {k: v for k, v in data["runs"].items() if k in live}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data
