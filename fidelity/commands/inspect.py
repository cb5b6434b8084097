"""`fidelity inspect CHECKPOINT`: a DeepSeek-native checkpoint's config, per-layer schedule,
tensor counts per dtype and total size, read from config.json and the shard headers only
(no tensor data is loaded, so it is instant on a 160 GB checkpoint). A folder holding only
a config.json (no safetensors yet) shows the schedule and the tensor table a checkpoint
for that config must have, with sizes (reference_model.checkpoint_format.expected_entries)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from fidelity.errors import CommandError
from reference_model.checkpoint import CheckpointError, scan_checkpoint
from reference_model.checkpoint_format import INDEX_NAME, expected_entries
from reference_model.checkpoint_read import _quant_problems
from reference_model.config import ConfigError
from reference_model.v41 import checkpoint_format as v41_format, checkpoint_read as v41_read, is_v41
from reference_model.v41.config import any_config_from_dict

HELP = "show a checkpoint's config, layer schedule and tensor table (headers only)"
EXAMPLES = """\
    fidelity inspect models/tiny-needle             # the embedded model
    fidelity inspect /models/DeepSeek-V4-Flash --json
"""


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors shards)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--all-tensors", action="store_true",
                   help="config-only folder: list every expected entry, not one row per tensor "
                        "kind (layers and experts folded)")


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def _layer_sizes(info) -> dict[int, tuple[int, int]]:
    out: dict[int, list[int]] = {}
    for name, h in info.tensors.items():
        if name.startswith("layers."):
            c = out.setdefault(int(name.split(".")[1]), [0, 0])
            c[0] += 1
            c[1] += h.nbytes
    return {i: (c[0], c[1]) for i, c in out.items()}


def summary(info) -> dict:
    cfg = info.cfg
    sizes = _layer_sizes(info)
    sched = []
    for row in cfg.schedule():
        n, b = sizes.get(row["layer"], (0, 0))
        sched.append({**row, "tensors": n, "bytes": b})
    return {
        "checkpoint": str(info.root),
        "config_file": str(info.config_file) if info.config_file else None,
        "layout": info.layout + (f" ({info.float_dtype})" if info.float_dtype else "")
                  + (", transformers naming" if info.naming == "transformers" else ""),
        "config": cfg.to_dict(),
        "shards": info.shards,
        "schedule": sched,
        "dtypes": {k: {"tensors": n, "bytes": b} for k, (n, b) in info.dtype_counts().items()},
        "total_tensors": len(info.tensors) + len(info.skipped),
        "total_bytes": info.total_bytes,
        "index_total_size": info.index_total_size,
        "skipped_tensors": len(info.skipped),
        "notes": info.notes,
        "problems": info.problems,
    }


def _config_and_schedule(s: dict, schedule_title: str) -> list[str]:
    L = ["", "## config", ""]
    for k, v in s["config"].items():
        L.append(f"  {k:<22} {v}")
    L += ["", f"## {schedule_title}", "",
          "| layer | kind | ratio | routing | rope_theta | yarn | tensors | size |",
          "|---:|---|---:|---|---:|---|---:|---:|"]
    for r in s["schedule"]:
        L.append(f"| {r['layer']} | {r['kind']} | {r['ratio']} | {r['routing']} | "
                 f"{r['rope_theta']:g} | {'yes' if r['yarn'] else 'no'} | {r['tensors']} | "
                 f"{_size(r['bytes'])} |")
    return L


def render(s: dict) -> str:
    L = [f"checkpoint: {s['checkpoint']}", f"config:     {s['config_file'] or '(given)'}",
         f"layout:     {s['layout']} (docs/weight-formats.md)"]
    L += _config_and_schedule(s, "layer schedule")
    L += ["", "## tensors by dtype", "", "| dtype | tensors | bytes | size |", "|---|---:|---:|---:|"]
    for k, d in s["dtypes"].items():
        L.append(f"| {k} | {d['tensors']} | {d['bytes']} | {_size(d['bytes'])} |")
    L.append(f"| **total** | {s['total_tensors']} | {s['total_bytes']} | {_size(s['total_bytes'])} |")
    L += ["", f"shards: {len(s['shards'])}" + (f"; index total_size: {s['index_total_size']}"
                                             if s["index_total_size"] is not None else "")]
    L += [f"note: {n}" for n in s["notes"]]
    if s["problems"]:
        L += ["", f"INVALID: {len(s['problems'])} problem(s):"] + [f"  - {p}" for p in s["problems"]]
    else:
        L += ["", "valid: every tensor the config needs is present with the right dtype and shape"]
    return "\n".join(L)


# ---- a folder with only a config.json --------------------------------------------------------
def _config_file(root: Path) -> Path | None:
    for p in (root / "config.json", root / "inference" / "config.json"):
        if p.is_file():
            return p
    return None


def is_config_only(path) -> bool:
    """A directory with a config.json (or inference/config.json) and no safetensors file."""
    root = Path(path)
    return (root.is_dir() and _config_file(root) is not None
            and not any(root.glob("*.safetensors")) and not (root / INDEX_NAME).exists())


def _pattern(name: str) -> str:
    """`layers.7.ffn.experts.12.w1.weight` -> `layers.*.ffn.experts.*.w1.weight`."""
    return re.sub(r"^layers\.\d+\.", "layers.*.", re.sub(r"\.experts\.\d+\.", ".experts.*.", name))


def config_summary(root: Path, all_tensors: bool = False) -> dict:
    """What a checkpoint for this folder's config holds: schedule with tensors and bytes per
    layer, entries by dtype, and the entry table (folded over layers and experts: one row
    per name pattern, dtype and shape, with its count)."""
    cfg_file = _config_file(root)
    try:
        raw = json.loads(cfg_file.read_text())
        if not isinstance(raw, dict):
            raise ConfigError("not a JSON object")
        cfg = any_config_from_dict(raw, name=root.name or "custom")     # V4 or V4.1
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{cfg_file} is invalid: {e}") from None
    ents = v41_format.expected_entries(cfg) if is_v41(cfg) else expected_entries(cfg)
    per_layer: dict[int, list[int]] = {}
    dtypes: dict[str, list[int]] = {}
    table: dict[tuple, list[int]] = {}
    for e in ents.values():
        if e.name.startswith("layers."):
            c = per_layer.setdefault(int(e.name.split(".")[1]), [0, 0])
            c[0] += 1
            c[1] += e.nbytes
        d = dtypes.setdefault(e.dtype, [0, 0])
        d[0] += 1
        d[1] += e.nbytes
        key = (e.name if all_tensors else _pattern(e.name), e.dtype, tuple(e.shape))
        t = table.setdefault(key, [0, 0])
        t[0] += 1
        t[1] += e.nbytes
    sched = [{**row, "tensors": per_layer.get(row["layer"], (0, 0))[0],
              "bytes": per_layer.get(row["layer"], (0, 0))[1]} for row in cfg.schedule()]
    return {
        "checkpoint": str(root),
        "config_file": str(cfg_file),
        "config_only": True,
        "config": cfg.to_dict(),
        "schedule": sched,
        "dtypes": {k: {"tensors": n, "bytes": b} for k, (n, b) in sorted(dtypes.items())},
        "tensors": [{"name": n, "dtype": d, "shape": list(shp), "count": c, "bytes": b}
                    for (n, d, shp), (c, b) in table.items()],
        "total_tensors": len(ents),
        "total_bytes": sum(e.nbytes for e in ents.values()),
        "problems": v41_read.quant_problems(raw) if is_v41(cfg) else _quant_problems(raw),
    }


def render_config_only(s: dict) -> str:
    L = [f"checkpoint: {s['checkpoint']} (config only: no safetensors files; the tables are "
         "what a checkpoint for this config holds)",
         f"config:     {s['config_file']}"]
    L += _config_and_schedule(s, "layer schedule (expected tensors)")
    L += ["", "## expected tensors", "",
          "| tensor | dtype | shape | count | bytes each | bytes | size |",
          "|---|---|---|---:|---:|---:|---:|"]
    for t in s["tensors"]:
        L.append(f"| {t['name']} | {t['dtype']} | {t['shape']} | {t['count']} | "
                 f"{t['bytes'] // t['count']} | {t['bytes']} | {_size(t['bytes'])} |")
    L += ["", "## expected tensors by dtype", "", "| dtype | tensors | bytes | size |",
          "|---|---:|---:|---:|"]
    for k, d in s["dtypes"].items():
        L.append(f"| {k} | {d['tensors']} | {d['bytes']} | {_size(d['bytes'])} |")
    L.append(f"| **total** | {s['total_tensors']} | {s['total_bytes']} | {_size(s['total_bytes'])} |")
    if s["problems"]:
        L += ["", f"INVALID: {len(s['problems'])} problem(s):"] + [f"  - {p}" for p in s["problems"]]
    else:
        L += ["", "config valid; no shards to check (`fidelity plan-memory --checkpoint DIR` "
              "plans the memory for it)"]
    return "\n".join(L)


def run(args) -> int:
    if is_config_only(args.checkpoint):
        try:
            s = config_summary(Path(args.checkpoint), args.all_tensors)
        except ConfigError as e:
            raise CommandError(str(e)) from None
        print(json.dumps(s, indent=2) if args.json else render_config_only(s))
        return 1 if s["problems"] else 0
    path = Path(args.checkpoint)
    if path.is_file() and path.suffix != ".safetensors":   # scan_checkpoint would read its folder
        raise CommandError(f"{path} is a file; give a checkpoint folder (config.json and "
                           "*.safetensors shards), a .safetensors file or a config-only folder")
    scan = v41_read.scan_checkpoint if v41_read.is_v41_checkpoint(args.checkpoint) else scan_checkpoint
    try:
        info = scan(args.checkpoint, strict=False)
    except CheckpointError as e:
        raise CommandError(str(e)) from None
    s = summary(info)
    print(json.dumps(s, indent=2) if args.json else render(s))
    return 1 if info.problems else 0
