"""Finished probes, one JSON line each, appended and flushed as they finish: a run that is
killed loses at most the probe in flight, and a rerun with the same settings skips every
probe whose key is already there (resume). A torn last line (killed mid-write) is ignored
and its probe run again."""
from __future__ import annotations

import json
import os
from pathlib import Path


class ProbeStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    self.rows.append(json.loads(line))
                except ValueError:
                    continue                  # a line cut by a kill: its probe runs again
        self.done = {r["key"] for r in self.rows}

    def has(self, key: str) -> bool:
        return key in self.done

    def add(self, row: dict) -> None:
        """Append one finished probe (it must carry its `key`)."""
        with self.path.open("a") as f:
            if f.tell() and not self.path.read_bytes().endswith(b"\n"):
                f.write("\n")                # after a torn line, start a fresh one
            f.write(json.dumps(row, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)
        self.done.add(row["key"])
