"""Bytes of a V4.1 model for `fidelity plan-memory` (fidelity/weights/plan_layers.py asks here for
V4.1 configs): per-layer weights in checkpoint and in-memory form, the dequantisation
buffer parts, and one sequence's state per layer.

Engram tables are not device memory: they stay in checkpoint form, memory-mapped on the
host, and only the rows gathered (24 per token per layer) move to the layer's device
(v41/weights.EngramTable). `layer_row` counts them apart, as `host_mapped`, at their
checkpoint bytes in every mode."""
from __future__ import annotations

from ..placement import place_layers
from ..specs import BF16, F32, FP4
from .checkpoint_format import disk_entries
from .specs import ENGRAM_TABLE, FP8_32, QUANTISED, global_specs, layer_specs

_MEM = {FP8_32: 2, FP4: 2, BF16: 2, F32: 4}          # held dequantised (bf16) or as stored
ENGRAM_HISTORY_BYTES = 8                              # one int64 compressed id per position


def spec_bytes(spec, mode: str) -> int:
    """'quantised': every safetensors entry incl. scales; otherwise the in-memory form."""
    if mode == "quantised" or spec.fmt == ENGRAM_TABLE:
        return sum(e.nbytes for e in disk_entries(spec))
    return spec.numel * _MEM[spec.fmt]


def layer_row(cfg, i: int) -> dict:
    """plan_layers.py's per-layer row: device weight bytes both ways, the largest GEMM weight
    (numel), the dequant buffer parts (all quantised tensors / all but routed experts / one
    routed expert) and the Engram table bytes kept memory-mapped on the host."""
    specs = layer_specs(cfg, i)
    tables = [s for s in specs if s.fmt == ENGRAM_TABLE]
    specs = [s for s in specs if s.fmt != ENGRAM_TABLE]
    q = [s for s in specs if s.fmt in QUANTISED]
    expert0 = f"layers.{i}.ffn.experts.0."
    return {"quantised": sum(spec_bytes(s, "quantised") for s in specs),
            "bf16": sum(spec_bytes(s, "bf16") for s in specs),
            "host_mapped": sum(spec_bytes(s, "quantised") for s in tables),
            "largest": max((s.numel for s in specs), default=0),
            "dequant": {"full": sum(s.numel * 2 for s in q),
                        "base": sum(s.numel * 2 for s in q if ".ffn.experts." not in s.name),
                        "expert": sum(s.numel * 2 for s in q if s.name.startswith(expert0))}}


def sequence_state_elements(cfg, i: int, length: int) -> dict[str, int]:
    """Elements of layer i's state after `length` tokens (doc §5.7):
      window      min(length, window_size - 1) latents x head_dim        (every layer)
      comp_kv     length // ratio compressed entries x head_dim          (KV sources)
      comp        the open ratio-2 group: (length % 2) kv + score rows   (ratio-2 KV sources)
      index_keys  length // ratio index keys x index_head_dim            (KV sources)
      engram      one compressed id per position, kept by the model      (first Engram layer)"""
    r = cfg.compress_ratios[i]
    out = {"window": min(length, cfg.window_size - 1) * cfg.head_dim,
           "comp_kv": 0, "comp": 0, "index_keys": 0, "engram": 0}
    if i in cfg.kv_source_layers:
        out["comp_kv"] = (length // r) * cfg.head_dim
        out["index_keys"] = (length // r) * cfg.index_head_dim
        if r == 2:
            out["comp"] = 2 * (length % 2) * cfg.head_dim
    if cfg.engram_layer_ids and i == cfg.engram_layer_ids[0]:
        out["engram"] = length
    return out


def sequence_state_bytes(cfg, i: int, length: int, dt) -> int:
    """Bytes of layer i's state for one sequence, in the profile's dtypes (plan.StateDtypes)."""
    e = sequence_state_elements(cfg, i, length)
    return ((e["window"] + e["comp_kv"]) * dt.kv + e["comp"] * dt.compressor
            + e["index_keys"] * dt.index_keys + e["engram"] * ENGRAM_HISTORY_BYTES)


def v41_placement(cfg, n_devices: int) -> list[int]:
    """Each layer's device: contiguous ranges balanced on in-memory weight bytes (V4's rule,
    V4.1's tensor table; Engram tables stay on the host, so they do not count)."""
    lb = [layer_row(cfg, i)["bf16"] for i in range(cfg.n_layers)]
    first = sum(spec_bytes(s, "bf16") for s in global_specs(cfg) if s.name.startswith("embed"))
    last = sum(spec_bytes(s, "bf16") for s in global_specs(cfg)) - first
    owner = [0] * cfg.n_layers
    for k, r in enumerate(place_layers(lb, n_devices, first, last)):
        for i in r:
            owner[i] = k
    return owner
