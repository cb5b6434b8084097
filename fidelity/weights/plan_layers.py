"""Byte arithmetic per tensor and per layer, from the config alone: weights in the
checkpoint and in-memory formats, the dequantisation buffer, one sequence's state, and the
dtypes a numerics profile keeps that state in. The plan (plan_devices) sums these per device;
V4.1's numbers come from reference_model/v41/sizes.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_model.checkpoint_format import disk_entries
from reference_model.config import ModelConfig
from reference_model.numerics import Numerics
from reference_model.placement import MEM_BYTES
from reference_model.specs import FP4, FP8, TensorSpec, global_specs, layer_specs
from reference_model.v41 import is_v41
from reference_model.v41 import sizes as v41_sizes
from reference_model.v41.specs import global_specs as v41_global_specs

from .plan_inputs import PROFILES, PlanError


@dataclass(frozen=True)
class StateDtypes:
    """Bytes per element of what a numerics profile keeps between steps."""
    kv: int            # window KV rows and compressed KV entries
    compressor: int    # compressor partial window (kv and score rows)
    index_keys: int    # indexer keys
    stream: int        # residual stream between layers (storage dtype)
    compute: int       # compute dtype (GEMM weight copies, logits before the fp32 cast)


def state_dtypes(profile="reference") -> StateDtypes:
    """Probe the profile's kernels on one small row each (a Numerics or a profile name:
    'reference' = fp64 compute, 'reference-fp32' = fp32 compute, 'exact'), so toggles that
    change a stored dtype are followed without restating them here."""
    if isinstance(profile, Numerics):
        nx = profile
    elif profile == "reference-fp32":
        nx = Numerics("reference", torch.float32)
    elif profile in ("reference", "exact"):
        nx = Numerics(profile)
    else:
        raise PlanError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    x = torch.linspace(-1, 1, 128, dtype=nx.cd).view(1, 128)
    kv = torch.promote_types(nx.kv_store(x[:, :64]).dtype, nx.rs(x[:, 64:]).dtype)
    ckv, csc = nx.compress_state(x, x)
    comp = torch.promote_types(ckv.dtype, csc.dtype)
    ik = nx.index_key_store(x).dtype
    size = lambda dt: torch.empty((), dtype=dt).element_size()   # noqa: E731
    return StateDtypes(size(kv), size(comp), size(ik), size(nx.sd), size(nx.cd))


# ---- per-layer arithmetic -----------------------------------------------------------------
def spec_bytes(spec: TensorSpec, mode: str) -> int:
    """Bytes of one tensor: checkpoint format ('quantised', every safetensors entry incl.
    scales) or in-memory format ('bf16')."""
    if mode == "quantised":
        return sum(e.nbytes for e in disk_entries(spec))
    return spec.numel * MEM_BYTES[spec.fmt]


def _is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def layer_weight_bytes(cfg: ModelConfig, i: int, mode: str) -> int:
    if is_v41(cfg):
        return layer_table(cfg)[i]["quantised" if mode == "quantised" else "bf16"]
    return sum(spec_bytes(s, mode) for s in layer_specs(cfg, i))


def version_global_specs(cfg) -> list[TensorSpec]:
    """The globals of the config's version (V4.1: no hc_head; reference_model/v41)."""
    return v41_global_specs(cfg) if is_v41(cfg) else global_specs(cfg)


def dequant_buffer_bytes(cfg: ModelConfig, i: int, mode: str = "full", tokens: int = 0) -> int:
    """bf16 bytes of layer i's FP8/FP4 tensors dequantised for use; 'expert-sparse' counts
    the routed experts a pass of `tokens` tokens can reach (bounded by n_routed_experts)."""
    if is_v41(cfg):
        return dequant_bytes(layer_table(cfg)[i]["dequant"], cfg, mode, tokens)
    return dequant_bytes(_dequant_parts(layer_specs(cfg, i), i), cfg, mode, tokens)


def _dequant_parts(specs, i: int) -> dict:
    q = [s for s in specs if s.fmt in (FP8, FP4)]
    return {"full": sum(s.numel * 2 for s in q),
            "base": sum(s.numel * 2 for s in q if not _is_routed_expert(s.name)),
            "expert": sum(s.numel * 2 for s in q if s.name.startswith(f"layers.{i}.ffn.experts.0."))}


def dequant_bytes(parts: dict, cfg: ModelConfig, mode: str, tokens: int) -> int:
    if mode == "full":
        return parts["full"]
    reach = min(cfg.n_routed_experts, max(0, tokens) * cfg.n_activated_experts)
    return parts["base"] + reach * parts["expert"]


def sequence_state_elements(cfg: ModelConfig, i: int, length: int) -> dict[str, int]:
    """Elements of layer i's SequenceState after `length` tokens (reference_model/model.py
    LayerState), by part:
      window      min(length, window_size - 1) rows x head_dim (the last window-1 KV rows)
      comp_kv     length // ratio compressed entries x head_dim          (ratio > 0)
      comp        compressor partial window: (length % ratio) pending kv + score rows of
                  width coff·head_dim (coff 2 for ratio 4, else 1); ratio 4 also keeps the
                  last complete group (ratio rows of kv + score) once length >= 4
      index_keys  length // 4 indexer keys x index_head_dim                 (ratio 4)
      index_comp  the indexer's ratio-4 compressor, as `comp` with index_head_dim"""
    r = cfg.compress_ratios[i]
    out = {"window": min(length, cfg.window_size - 1) * cfg.head_dim,
           "comp_kv": 0, "comp": 0, "index_keys": 0, "index_comp": 0}

    def partial(ratio, d):
        width = (2 if ratio == 4 else 1) * d
        n = 2 * (length % ratio) * width
        if ratio == 4 and length >= ratio:
            n += 2 * ratio * width
        return n

    if r:
        out["comp_kv"] = (length // r) * cfg.head_dim
        out["comp"] = partial(r, cfg.head_dim)
    if r == 4:
        out["index_keys"] = (length // 4) * cfg.index_head_dim
        out["index_comp"] = partial(4, cfg.index_head_dim)
    return out


def sequence_state_bytes(cfg: ModelConfig, i: int, length: int, dt: StateDtypes) -> int:
    """Bytes of layer i's state for one sequence of `length` tokens."""
    if is_v41(cfg):                      # shared compressed KV, Engram history (v41/sizes.py)
        return v41_sizes.sequence_state_bytes(cfg, i, length, dt)
    e = sequence_state_elements(cfg, i, length)
    return ((e["window"] + e["comp_kv"]) * dt.kv + (e["comp"] + e["index_comp"]) * dt.compressor
            + e["index_keys"] * dt.index_keys)


def _largest_weight_numel(specs) -> int:
    return max((s.numel for s in specs), default=0)


def layer_table(cfg: ModelConfig) -> list[dict]:
    """Per-layer weight numbers that do not depend on the run (cached per config)."""
    key = cfg.config_hash()
    if key not in _CACHE:
        rows = []
        for i in range(cfg.n_layers):
            if is_v41(cfg):
                rows.append(v41_sizes.layer_row(cfg, i))
                continue
            specs = layer_specs(cfg, i)
            rows.append({"quantised": sum(spec_bytes(s, "quantised") for s in specs),
                         "bf16": sum(spec_bytes(s, "bf16") for s in specs),
                         "largest": _largest_weight_numel(specs),
                         "dequant": _dequant_parts(specs, i)})
        _CACHE.clear()
        _CACHE[key] = rows
    return _CACHE[key]


_CACHE: dict = {}
