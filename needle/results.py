"""One append-only JSONL per sweep: a header line describing how trials are generated,
then one line per (arm, trial). Each line is written with a single O_APPEND write, so a
killed sweep leaves at most one torn last line, which the next open cuts off. Resume is
the default: trials whose latest row is not a server error are not run again."""
from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA_VERSION = 1


class ResultsError(ValueError):
    """A results file that belongs to a different sweep, or cannot be read."""


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (no trailing newline) left by a killed writer."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_rows(path: str | Path) -> tuple[dict | None, list[dict]]:
    """(header, trial rows) of a results file; unparsable lines are skipped."""
    path = Path(path)
    header, rows = None, []
    if not path.exists():
        return None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("type") == "header" and header is None:
            header = r
        elif r.get("type") == "trial":
            rows.append(r)
    return header, rows


def latest(rows: list[dict]) -> list[dict]:
    """The last row of each (arm, trial_id), in first-seen order."""
    out: dict[tuple, dict] = {}
    for r in rows:
        out[(r["arm"], r["trial_id"])] = r
    return list(out.values())


class ResultsLog:
    def __init__(self, path: str | Path, header: dict, fresh: bool = False):
        """Open (or start) the log. `header["trials"]` must match an existing file's
        (same trial generation), otherwise the rows would not be comparable."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists():
            self.path.unlink()
        if self.path.exists():
            _repair_tail(self.path)
            old, rows = read_rows(self.path)
            if old is not None and old.get("trials") != header.get("trials"):
                raise ResultsError(
                    f"{self.path} was written by a sweep with different trial settings "
                    f"({json.dumps(old.get('trials'), sort_keys=True)}); use --fresh or another --out")
            self.rows = rows
            if old is None:
                self._write({"type": "header", "schema_version": SCHEMA_VERSION, **header})
        else:
            self.rows = []
            self._write({"type": "header", "schema_version": SCHEMA_VERSION, **header})

    def _write(self, obj: dict) -> None:
        line = (json.dumps(obj, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def done(self) -> set[tuple[str, str]]:
        """(arm, trial_id) pairs that need no rerun."""
        return {(r["arm"], r["trial_id"]) for r in latest(self.rows) if r["outcome"] != "server_error"}

    def append(self, row: dict) -> None:
        row = {"type": "trial", "schema_version": SCHEMA_VERSION, **row}
        self._write(row)
        self.rows.append(row)
