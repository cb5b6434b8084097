"""Weights as the forward consumes them, keyed by DeepSeek-native names.

A weight source hands out the global tensors and one layer at a time (names with the
`layers.{i}.` prefix stripped), so a streamed checkpoint and an in-memory dict look the
same to the model. Quantised weights are held dequantised (bf16 is exact for e4m3 × 2^k
and e2m1 × 2^k), everything else in its checkpoint dtype."""
from __future__ import annotations

from typing import Protocol

import torch

from . import quant as Q
from .config import ModelConfig
from .specs import BF16, F32, FP4, FP8, I64
from .tables import all_specs, global_specs, layer_specs
from .v41.engram_table import encode_rows
from .v41.specs import ENGRAM_TABLE, FP8_32


class WeightSource(Protocol):
    cfg: ModelConfig

    def global_weights(self) -> dict[str, torch.Tensor]: ...

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]: ...


class InMemoryWeights:
    """All weights in one dict of full native names (either version: the config's table)."""

    resident = True        # models may keep converted copies (see Model._weights)

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.tensors = tensors
        self._globals = {s.name: tensors[s.name] for s in global_specs(cfg)}
        self._layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            self._layers.append({s.name[len(p):]: tensors[s.name] for s in layer_specs(cfg, i)})

    def global_weights(self):
        return self._globals

    def layer_weights(self, i):
        return self._layers[i]

    def to(self, device) -> "InMemoryWeights":
        return InMemoryWeights(self.cfg, {k: v.to(device) for k, v in self.tensors.items()})


def _init_value(spec, g: torch.Generator, cfg) -> torch.Tensor:
    """Random values with a sane scale per tensor kind (so activations stay O(1))."""
    name, shape = spec.name, spec.shape
    if spec.fmt == I64:                                     # tid2eid: distinct experts per token
        rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int64)
    if name.endswith(("norm.weight", "q_weight", "k_weight")):   # V4.1 Engram gates: q/k_weight
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("_fn"):
        return torch.randn(shape, generator=g) * (0.5 / shape[1] ** 0.5)
    if name.endswith("attn_sink"):
        return torch.randn(shape, generator=g)
    if name.endswith("ape"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * torch.randn(shape, generator=g)
    if name == "embed.weight" or spec.fmt == ENGRAM_TABLE:
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5     # linear [out, in]


def to_grid(spec, w: torch.Tensor, block: int = 32):
    """Put a float tensor onto its checkpoint format's grid, as held in memory (FP8: V4's
    128x128 blocks; FP8_32: V4.1's `block`; Engram tables stay in checkpoint form)."""
    if spec.fmt in (FP8, FP8_32):
        b = 128 if spec.fmt == FP8 else block
        q, s = Q.quantize_fp8_weight(w, b)
        return Q.dequant_fp8_weight(q, s, b).to(torch.bfloat16)
    if spec.fmt == FP4:
        q, s = Q.quantize_fp4_weight(w)
        return (q * s.repeat_interleave(32, -1)).to(torch.bfloat16)
    if spec.fmt == ENGRAM_TABLE:
        return encode_rows(w)
    if spec.fmt == BF16:
        return w.to(torch.bfloat16)
    if spec.fmt == F32:
        return w.to(torch.float32)
    if spec.fmt == I64:
        return w
    raise ValueError(f"{spec.name}: unknown format {spec.fmt!r}")


def random_weights(cfg, seed: int = 0) -> InMemoryWeights:
    """Deterministic random weights for any config of either version, already on the
    checkpoint grids (same seed, same bits; a written and re-read checkpoint is identical)."""
    g = torch.Generator().manual_seed(seed)
    block = getattr(cfg, "weight_block_size", 128)
    tensors = {s.name: to_grid(s, _init_value(s, g, cfg), block) for s in all_specs(cfg)}
    return InMemoryWeights(cfg, tensors)


_MEM_DTYPE = {FP8: torch.bfloat16, FP4: torch.bfloat16, BF16: torch.bfloat16,
              F32: torch.float32, I64: torch.int64}


def meta_weights(cfg: ModelConfig) -> InMemoryWeights:
    """Every tensor of the config on the meta device (shapes and dtypes, no storage):
    builds the full 284B-parameter Flash model without memory."""
    return InMemoryWeights(cfg, {s.name: torch.empty(s.shape, dtype=_MEM_DTYPE[s.fmt], device="meta")
                                 for s in all_specs(cfg)})
