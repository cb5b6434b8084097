"""The shard level of a safetensors checkpoint, for both versions' readers: where the config
and shards are, every shard's headers, the index against them, a reader that keeps one
memory-mapped shard open at a time, and the one-layer-at-a-time weight source. What the
tensors must be is the version's (checkpoint_read.py, v41/checkpoint_read.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint_format import (INDEX_NAME, SINGLE_NAME, CheckpointError, ShardError, TensorHeader,
                                natural_key, read_header)
from .tables import global_specs, layer_specs


@dataclass
class CheckpointInfo:
    """What the headers say: config, every main-model tensor header, skipped MTP/DSpark
    tensors, shards, notes and (when scanned non-strictly) the problems found."""
    root: Path
    cfg: ModelConfig | None
    config_file: Path | None
    tensors: dict[str, TensorHeader]
    skipped: dict[str, TensorHeader]
    shards: list[str]
    index_total_size: int | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    layout: str = "native"                   # checkpoint_format.LAYOUTS
    naming: str = "native"                   # "transformers": save_pretrained's names, mapped
    float_dtype: str | None = None           # native-dense: the floats the tensors are in

    @property
    def total_bytes(self) -> int:
        return sum(h.nbytes for h in self.tensors.values()) + sum(h.nbytes for h in self.skipped.values())

    def dtype_counts(self, include_skipped: bool = True) -> dict[str, tuple[int, int]]:
        """dtype -> (tensor count, bytes)."""
        out: dict[str, list[int]] = {}
        hs = list(self.tensors.values()) + (list(self.skipped.values()) if include_skipped else [])
        for h in hs:
            c = out.setdefault(h.dtype, [0, 0])
            c[0] += 1
            c[1] += h.nbytes
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def _find_config(root: Path) -> Path | None:
    for p in (root / "config.json", root / "inference" / "config.json"):
        if p.is_file():
            return p
    return None


def _shard_files(root: Path, problems: list[str]):
    """-> (weight_map name->file or None, files, index total_size)."""
    idx = root / INDEX_NAME
    if idx.is_file():
        try:
            d = json.loads(idx.read_text())
            wm = d["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(str(root), [f"index {INDEX_NAME} is invalid: {e!r}"]) from None
        files = sorted(set(wm.values()), key=natural_key)
        total = (d.get("metadata") or {}).get("total_size")
        return wm, files, total
    if (root / SINGLE_NAME).is_file():
        return None, [SINGLE_NAME], None
    files = sorted((p.name for p in root.glob("*.safetensors")), key=natural_key)
    if not files:
        raise CheckpointError(str(root), [f"no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors files"])
    return None, files, None


def _read_headers(root: Path, files, wm, problems: list[str]) -> tuple[dict, set[str]]:
    """Every shard's tensor headers by name; a missing or corrupt shard is a problem (and
    its tensors are not reported again one by one)."""
    headers: dict[str, TensorHeader] = {}
    bad_files: set[str] = set()
    for f in files:
        p = root / f
        if not p.is_file():
            n = sum(1 for v in (wm or {}).values() if v == f)
            problems.append(f"missing shard: {f} (the index maps {n} tensors to it)")
            bad_files.add(f)
            continue
        try:
            hs, _ = read_header(p)
        except ShardError as e:
            problems.append(f"corrupt shard: {f}: {e}")
            bad_files.add(f)
            continue
        for name, h in hs.items():
            if name in headers:
                problems.append(f"duplicate tensor: {name} is in {headers[name].file} and {f}")
            else:
                headers[name] = h
    return headers, bad_files


def _check_index(wm: dict, headers: dict, bad_files: set[str], total, problems: list[str],
                 notes: list[str]) -> None:
    """The index's weight map against the shards' headers (and its total size)."""
    bad = [n for n, f in wm.items() if f not in bad_files and (n not in headers or headers[n].file != f)]
    for name in sorted(bad, key=natural_key):
        f = wm[name]
        where = f"it is in {headers[name].file}" if name in headers else "no shard has it"
        problems.append(f"index mismatch: {INDEX_NAME} maps {name} to {f}, but {where}")
    for name in sorted(set(headers) - set(wm), key=natural_key):
        problems.append(f"index mismatch: {name} is in {headers[name].file} but not in {INDEX_NAME}")
    if total is not None:
        real = sum(h.nbytes for h in headers.values())
        if not bad_files and real != total:
            notes.append(f"index metadata.total_size is {total}, tensors sum to {real} bytes")


class _ShardReader:
    """Memory-mapped `safe_open` handles, one at a time, reopened after `chunk_bytes` so
    the file pages touched so far are unmapped (they count in RSS while mapped)."""

    def __init__(self, root: Path, chunk_bytes: int):
        self.root, self.chunk = root, chunk_bytes
        self.file, self.handle, self.read = None, None, 0

    def get(self, h: TensorHeader) -> torch.Tensor:
        if self.file != h.file or self.read >= self.chunk:
            self.close()
            try:
                self.handle = safe_open(str(self.root / h.file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"checkpoint {self.root}",
                                      [f"corrupt shard: {h.file}: cannot open: {e}"]) from None
            self.file, self.read = h.file, 0
        try:
            t = self.handle.get_tensor(h.name)
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.root}",
                                  [f"corrupt shard: {h.file}: cannot read {h.name}: {e}"]) from None
        self.read += h.nbytes
        return t

    def close(self):
        self.file, self.handle, self.read = None, None, 0


class LayerStream:
    """A WeightSource over a scanned checkpoint: globals loaded once, ONE layer resident
    (asking for layer j drops layer i first). Subclasses give the version's `scan` and
    `load(specs, strip)`; `loads` counts layer loads (for tests)."""

    resident = False        # Model must not keep converted copies of streamed layers

    def __init__(self, path, device="cpu", cfg=None):
        self.info = path if isinstance(path, CheckpointInfo) else self.scan(path, cfg)
        self.cfg = self.info.cfg
        self.device = torch.device(device)
        self._globals: dict | None = None
        self._layer_i: int | None = None
        self._layer: dict | None = None
        self.loads = 0

    @property
    def notes(self) -> list[str]:
        return self.info.notes

    def global_weights(self) -> dict:
        if self._globals is None:
            self._globals = self.load(global_specs(self.cfg))
        return self._globals

    def layer_weights(self, i: int) -> dict:
        if not 0 <= i < self.cfg.n_layers:
            raise IndexError(f"layer {i} out of range 0..{self.cfg.n_layers - 1}")
        if self._layer_i != i:
            self._layer_i, self._layer = None, None          # free before loading the next
            self._layer = self.load(layer_specs(self.cfg, i), f"layers.{i}.")
            self._layer_i = i
            self.loads += 1
        return self._layer

    def release(self):
        """Drop the cached layer (the globals stay)."""
        self._layer_i, self._layer = None, None
