"""Add an MTP layer to an existing DeepSeek-native checkpoint without touching its main
shards: the `mtp.{k}.*` tensors (encoded on their checkpoint grids, reference_model/
checkpoint_write.encode) go to a shard of their own, the index maps them, and config.json
gets num_nextn_predict_layers and the trailing compress_ratios entry (0: the MTP layer is
window-only) as DeepSeek's config has them. Written to temp files, then renamed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint_format import INDEX_NAME, SINGLE_NAME
from .checkpoint_write import encode
from .config import ModelConfig
from .mtp import MTPError, mtp_specs


def _replace_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def add_mtp_layer(root, tensors: dict[str, torch.Tensor], k: int = 0,
                  shard: str | None = None) -> Path:
    """Write MTP layer k (`tensors` named without `mtp.{k}.`, on their grids) beside the
    checkpoint at `root`; returns the new shard's path. The checkpoint must have an index
    (a single model.safetensors is refused: it would need rewriting)."""
    root = Path(root)
    cfg = ModelConfig.from_file(root / "config.json")
    if cfg.n_mtp_layers != k:
        raise MTPError(f"{root}: has {cfg.n_mtp_layers} MTP layers; can only add layer {cfg.n_mtp_layers}")
    idx_path = root / INDEX_NAME
    if not idx_path.is_file():
        what = SINGLE_NAME if (root / SINGLE_NAME).is_file() else "no index"
        raise MTPError(f"{root}: {what}: an MTP shard can only be added to an indexed checkpoint")
    p = f"mtp.{k}."
    specs = mtp_specs(cfg, k)
    missing = [s.name for s in specs if s.name[len(p):] not in tensors]
    if missing:
        raise MTPError(f"MTP layer {k}: missing tensors {', '.join(missing[:5])}"
                       + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    entries = {}
    for s in specs:
        entries.update(encode(s, tensors[s.name[len(p):]]))
    shard = shard or f"model-mtp{k}.safetensors"
    out = root / shard
    tmp = root / (shard + ".tmp")
    save_file({n: v.contiguous() for n, v in entries.items()}, str(tmp))
    os.chmod(tmp, 0o644)                       # as the other shards, whatever the temp file got
    os.replace(tmp, out)
    index = json.loads(idx_path.read_text())
    for n in entries:
        index["weight_map"][n] = shard
    meta = index.setdefault("metadata", {})
    if "total_size" in meta:
        meta["total_size"] += sum(v.numel() * v.element_size() for v in entries.values())
    _replace_json(idx_path, index)
    conf = json.loads((root / "config.json").read_text())
    conf["num_nextn_predict_layers"] = k + 1
    if isinstance(conf.get("compress_ratios"), list):
        conf["compress_ratios"] = conf["compress_ratios"][:cfg.n_layers + k] + [0]
    _replace_json(root / "config.json", conf)
    return out
