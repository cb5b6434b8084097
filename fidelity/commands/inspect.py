"""`fidelity inspect CHECKPOINT`: a DeepSeek-native checkpoint's config, per-layer schedule,
tensor counts per dtype and total size, read from config.json and the shard headers only
(no tensor data is loaded, so it is instant on a 160 GB checkpoint)."""
from __future__ import annotations

import json
import sys

HELP = "show a checkpoint's config, layer schedule and tensor table (headers only)"


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors shards)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


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


def render(s: dict) -> str:
    L = [f"checkpoint: {s['checkpoint']}",
         f"config:     {s['config_file'] or '(given)'}", "", "## config", ""]
    for k, v in s["config"].items():
        L.append(f"  {k:<22} {v}")
    L += ["", "## layer schedule", "",
          "| layer | kind | ratio | routing | rope_theta | yarn | tensors | size |",
          "|---:|---|---:|---|---:|---|---:|---:|"]
    for r in s["schedule"]:
        L.append(f"| {r['layer']} | {r['kind']} | {r['ratio']} | {r['routing']} | "
                 f"{r['rope_theta']:g} | {'yes' if r['yarn'] else 'no'} | {r['tensors']} | "
                 f"{_size(r['bytes'])} |")
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


def run(args) -> int:
    from reference_model.checkpoint import CheckpointError, scan_checkpoint
    try:
        info = scan_checkpoint(args.checkpoint, strict=False)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summary(info)
    print(json.dumps(s, indent=2) if args.json else render(s))
    return 1 if info.problems else 0
