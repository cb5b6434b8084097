"""A history's append-only record: one JSON line per finished stage (the latest line of a
(stage, key) is its result), so a long history resumes where it stopped and loses nothing."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path


class Ledger:
    """<history>/history.jsonl read once, appended to line by line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lines: list[dict] = []
        if self.path.is_file():
            for n, ln in enumerate(self.path.read_text().splitlines(), 1):
                if ln.strip():
                    try:
                        self.lines.append(json.loads(ln))
                    except ValueError:
                        raise ValueError(f"{self.path}:{n} is not JSON (a line cut short?); "
                                         "remove it and rerun") from None

    def add(self, stage: str, key, **rec) -> dict:
        rec = {"stage": stage, "key": key, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **rec}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        self.lines.append(rec)
        return rec

    def get(self, stage: str, key) -> dict | None:
        return next((r for r in reversed(self.lines) if r["stage"] == stage and r["key"] == key), None)

    def all(self, stage: str) -> list[dict]:
        latest: dict = {}
        for r in self.lines:
            if r["stage"] == stage:
                latest[json.dumps(r["key"])] = r
        return list(latest.values())


def failure_reason(output: str) -> str:
    """The line that says why a stage failed (a compiler error, a download error, a traceback's
    last word), else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for pat in (r"\berror\b", r"ERROR", r"failed"):
        hit = [ln for ln in lines if re.search(pat, ln)]
        if hit:
            return hit[0][:300]
    return lines[-1][:300] if lines else "no output"
