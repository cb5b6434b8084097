"""A checkpoint made ready for llama.cpp, once, in the build folder: widened when llama.cpp
cannot load it as it is (pad_heads.py: head_dim == index_head_dim), then converted to GGUF
(convert.py). Both results are cached by what they were made from."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import convert, paths
from .pad_heads import pad_checkpoint

WIDE_HEAD_DIM = 512                     # the released models' head_dim


def needs_widening(model_dir: Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("head_dim") == cfg.get("index_head_dim")


def llama_checkpoint(model_dir: Path) -> Path:
    """The checkpoint llama.cpp is given: `model_dir` itself, or its widened copy (computing
    the same function; the golden is run on the same copy)."""
    model_dir = Path(model_dir).resolve()
    if not needs_widening(model_dir):
        return model_dir
    out = paths.require() / "models" / f"{model_dir.name}-hd{WIDE_HEAD_DIM}"
    if (out / "config.json").is_file() and _stale(model_dir, out):
        shutil.rmtree(out)
    if not (out / "config.json").is_file():
        pad_checkpoint(model_dir, out, WIDE_HEAD_DIM)
    return out


def _stale(src: Path, out: Path) -> bool:
    newest = max(p.stat().st_mtime_ns for p in src.iterdir() if p.is_file())
    return (out / "config.json").stat().st_mtime_ns < newest


def gguf(model_dir: Path, fp8: str = "q8_0", build: paths.Build | None = None) -> tuple[Path, Path]:
    """(the checkpoint llama.cpp runs, its GGUF by `build`'s converter, default the pinned one's)."""
    ck = llama_checkpoint(model_dir)
    return ck, convert.cached(ck, fp8, build)
