"""llama.cpp's intermediate tensors, read whole: run `llama-fidelity-dump` (tensor_dump.cpp,
built beside llama.cpp) on token ids and read its records back as numpy arrays in the
golden's orientation ([tokens, ...], ggml's ne[0] last), one array per tensor name, the
decode path's steps concatenated along the token axis."""
from __future__ import annotations

import struct
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np

from . import paths

PROGRAM = "llama-fidelity-dump"


class DumpError(RuntimeError):
    pass


def run(gguf: Path, ids: list[int], out: Path, path: str = "prefill", pattern: str = ".",
        cache: str = "f16", build: paths.Build | None = None) -> Path:
    """Dump the tensors matching `pattern` while llama.cpp evaluates `ids` by `path`
    (prefill: one batch; decode: one token per step) with its KV cache in `cache` (f16 or
    q8_0, llama-server's -ctk/-ctv), with `build`'s dumper (default the pinned build's)."""
    out = Path(out)
    ids_file = out.with_suffix(".ids")
    np.asarray(ids, "<i4").tofile(ids_file)
    r = subprocess.run([str((build or paths.pinned()).program(PROGRAM)), str(gguf), str(ids_file), str(out), path, pattern, cache],
                       capture_output=True, text=True, errors="replace")
    if r.returncode != 0:
        raise DumpError(f"{PROGRAM} failed (exit {r.returncode}): {r.stderr[-1500:]}")
    return out


def read(path: Path) -> dict[str, np.ndarray]:
    """name -> array. A tensor seen at several steps (the decode path) is concatenated along
    its token axis (ggml's ne[1], which becomes axis 0 here)."""
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    seen: dict[tuple[int, str], int] = defaultdict(int)
    with open(path, "rb") as f:
        while head := f.read(4):
            (n,) = struct.unpack("<I", head)
            name = f.read(n).decode()
            step, kind = struct.unpack("<II", f.read(8))
            seen[step, name] += 1                  # one name on several nodes: name#2, name#3
            name = name if seen[step, name] == 1 else f"{name}#{seen[step, name]}"
            ne = struct.unpack("<4q", f.read(32))
            count = int(np.prod(ne))
            a = np.frombuffer(f.read(4 * count), "<i4" if kind else "<f4")
            if a.size != count:
                raise DumpError(f"{path}: record {name!r} is truncated")
            parts[name].append(a.reshape(ne[::-1]).squeeze(axis=tuple(i for i in (0, 1) if ne[3 - i] == 1)))
    return {k: v[0] if len(v) == 1 else _concat(v) for k, v in parts.items()}


def _concat(arrs: list[np.ndarray]) -> np.ndarray:
    """Per-step arrays of one tensor joined on the token axis (the second-fastest ggml
    dim); steps whose shapes cannot be joined (e.g. a cache view that grows) stay a list."""
    try:
        return np.concatenate([a if a.ndim > 1 else a[None] for a in arrs], axis=-2 if arrs[0].ndim > 1 else 0)
    except ValueError:
        return arrs

