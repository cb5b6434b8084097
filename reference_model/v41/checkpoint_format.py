"""On-disk layout of a DeepSeek-V4.1 checkpoint (docs/v41-architecture.md §6, §11): the
safetensors entries each V4.1 TensorSpec becomes, and the tensor names that betray the
other version (a V4 checkpoint labelled V4.1, or the converse), so a mislabelled file gets
one named error instead of a thousand missing-tensor lines."""
from __future__ import annotations

from ..checkpoint_format import DiskEntry, disk_entries as v4_disk_entries, scale_name
from ..specs import FP4
from .config import WEIGHT_BLOCK, V41Config
from .specs import ENGRAM_TABLE, FP8_32, TensorSpec, all_specs

ENGRAM_SCALE_BLOCK = 32        # one E8M0 scale per 32 channels of an Engram row


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def disk_entries(spec: TensorSpec, block: int = WEIGHT_BLOCK) -> list[DiskEntry]:
    """FP8_32: F8_E4M3 [out,in] + F8_E8M0 [ceil(out/32), ceil(in/32)]; ENGRAM_TABLE: F8_E4M3
    [rows, head_dim] + F8_E8M0 [rows, head_dim/32]; FP4, bf16, f32 as in V4."""
    if spec.fmt == FP8_32:
        out, inp = spec.shape
        return [DiskEntry(spec.name, "F8_E4M3", (out, inp), "weight"),
                DiskEntry(scale_name(spec.name), "F8_E8M0", (_ceil(out, block), _ceil(inp, block)), "scale")]
    if spec.fmt == ENGRAM_TABLE:
        rows, hd = spec.shape
        return [DiskEntry(spec.name, "F8_E4M3", (rows, hd), "weight"),
                DiskEntry(scale_name(spec.name), "F8_E8M0", (rows, _ceil(hd, ENGRAM_SCALE_BLOCK)), "scale")]
    return v4_disk_entries(spec)


def expected_entries(cfg: V41Config) -> dict[str, DiskEntry]:
    """Every safetensors entry of the V4.1 backbone for `cfg` (nothing allocated)."""
    out = {}
    for s in all_specs(cfg):
        for e in disk_entries(s, cfg.weight_block_size):
            out[e.name] = e
    return out


def quantised_weight_of(scale: str, specs: dict[str, TensorSpec]) -> TensorSpec | None:
    w = scale[: -len(".scale")] + ".weight"
    s = specs.get(w)
    return s if s is not None and s.fmt in (FP8_32, FP4, ENGRAM_TABLE) else None


# ---- the other version's signatures ----------------------------------------------------------
_V4_ONLY = ("hc_head_fn", "hc_head_base", "hc_head_scale", ".ffn.gate.tid2eid",
            ".attn.compressor.ape", ".attn.indexer.compressor.")
_V41_ONLY = (".engram.", ".attn.indexer.wk.", ".attn.indexer.k_norm.", ".ffn.gate.bias_vl")


def v4_signatures(names) -> list[str]:
    """Names only a DeepSeek-V4 checkpoint has (first example of each kind)."""
    out = []
    for mark in _V4_ONLY:
        hit = next((n for n in sorted(names) if mark in n or n == mark), None)
        if hit:
            out.append(f"{hit} present")
    return out


def v41_signatures(names) -> list[str]:
    """Names only a DeepSeek-V4.1 checkpoint has (first example of each kind)."""
    out = []
    for mark in _V41_ONLY:
        hit = next((n for n in sorted(names) if mark in n), None)
        if hit:
            out.append(f"{hit} present")
    return out


def block128_scale(entry: DiskEntry, spec: TensorSpec, found: tuple[int, ...]) -> bool:
    """Does a wrong FP8 scale shape fit DeepSeek-V4's 128x128 grid (the llama.cpp #28696
    case: 128-block scales read against 32x32 weights)?"""
    if spec.fmt != FP8_32 or entry.role != "scale":
        return False
    out, inp = spec.shape
    return tuple(found) == (_ceil(out, 128), _ceil(inp, 128))
