"""What every step of one `fidelity engines run` shares: the run's state.json (`State`:
tasks finished per arm, and the run log of what happened in which order) and the run
itself (`EngineRun`: the spec, its output folder, the KLD prompts and settings, the score
store, the target the prompts were built with, progress), passed whole instead of eight
arguments to each step."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from fidelity.kld.settings import KldSettings
from fidelity.scores.store import ScoreStore
from fidelity.progress import Progress

from .spec import Spec

RUN_LOG = "run log"          # state.json's list of runs (a key no arm name can be: it has a space)


class State:
    """Per arm: tasks finished, the engine's own view, start-up seconds (state.json); and
    per run (RUN_LOG), what happened in which order: the golden scored, its memory released,
    each engine launched and stopped."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {}

    def arm(self, name: str) -> dict:
        return self.data.setdefault(name, {"done": []})

    def begin(self) -> None:
        self.data.setdefault(RUN_LOG, []).append({"started": time.time(), "events": []})

    def event(self, what: str, **details) -> None:
        """One step of this run, in order, saved at once (a run that dies keeps its log)."""
        if not self.data.get(RUN_LOG):
            self.begin()
        self.data[RUN_LOG][-1]["events"].append({"event": what, "at": time.time(), **details})
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


@dataclass
class EngineRun:
    """One engines run: its spec and folder, state, KLD prompts and settings, score store,
    target (tokenizer and config) and progress."""
    spec: Spec
    root: Path
    state: State
    prompts: list
    settings: KldSettings
    store: ScoreStore
    target: object
    progress: Progress
