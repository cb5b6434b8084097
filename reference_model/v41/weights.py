"""V4.1 weights as the forward consumes them, keyed by DeepSeek-native names, and seeded
random weights for any V4.1 config (already on the checkpoint grids, so a written and
re-read checkpoint is bit-identical).

Quantised weights are held dequantised in bf16 (exact, as in V4), except the Engram tables:
they stay in checkpoint form (`EngramTable`: e4m3 codes + E8M0 per 32 channels) on the host
and are gathered row by row, because the release's are ~94 GiB each (two layers) and a
token needs 24 rows of each."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant as Q
from ..specs import BF16, F32, FP4
from .config import V41Config
from .specs import ENGRAM_TABLE, FP8_32, all_specs, global_specs, layer_specs

ROW_BLOCK = 32


@dataclass
class EngramTable:
    """An Engram table in checkpoint form: codes F8_E4M3 [rows, head_dim], scale F8_E8M0
    [rows, head_dim/32]; `lookup(ids)` dequantises only the rows asked for.

    The table stays on the host: read from a checkpoint, codes and scale are views of the
    memory-mapped shard (safetensors mmap), so it takes no device memory and only the pages
    of gathered rows are read; `lookup` moves just those rows to the ids' device. Its codes
    are checked for e4m3 NaN as they are gathered (a load-time scan would read it whole)."""
    codes: torch.Tensor
    scale: torch.Tensor
    name: str = "Engram table"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """rows = e4m3(codes[id]) · 2^(scale[id] - 127) per 32 channels, in fp32 -> bf16
        (exact: an e4m3 value times a power of two fits bf16), on ids' device. ids any
        shape -> [..., hd]."""
        flat = ids.reshape(-1).to(self.codes.device)
        codes = self.codes.index_select(0, flat)
        if Q.has_e4m3_nan(codes):
            raise ValueError(f"{self.name}: a gathered row holds e4m3 NaN codes (0x7F/0xFF)")
        c = Q.e4m3_to_float(codes)
        s = Q.e8m0_to_float(self.scale.index_select(0, flat)).repeat_interleave(ROW_BLOCK, -1)
        rows = (c * s[:, : c.shape[-1]]).to(torch.bfloat16).view(*ids.shape, c.shape[-1])
        return rows.to(ids.device)

    def dequant(self) -> torch.Tensor:
        return self.lookup(torch.arange(self.codes.shape[0]))

    def to(self, device) -> "EngramTable":
        """Itself: the table stays on the host wherever its layer runs (only gathered rows
        move), so moving a layer's weights to a device leaves it where it is."""
        return self


def encode_rows(w: torch.Tensor, block: int = ROW_BLOCK) -> EngramTable:
    """A float table -> e4m3 codes with the smallest power-of-two scale per 1x32 block that
    holds it (amax/s <= 448), so a table already on the grid is encoded exactly."""
    from ..checkpoint_write import _e8m0, _min_pow2_exp
    rows, hd = w.shape
    if hd % block:
        raise ValueError(f"Engram head_dim {hd} is not a multiple of {block}")
    wf = w.float().unflatten(-1, (-1, block))
    k = _min_pow2_exp(wf.abs().amax(-1), 0.875, 9)          # 448 = 0.875·2^9
    s = torch.ldexp(torch.ones_like(wf[..., 0]), k).unsqueeze(-1)
    q = (wf / s).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return EngramTable(q.contiguous(), _e8m0(k).contiguous())


class V41Weights:
    """All weights of a V4.1 backbone in one dict of full native names; hands out the
    globals and one layer at a time (prefix stripped), like V4's InMemoryWeights."""

    resident = True

    def __init__(self, cfg: V41Config, tensors: dict):
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

    def to(self, device) -> "V41Weights":
        return V41Weights(self.cfg, {k: v.to(device) for k, v in self.tensors.items()})


def _init_value(spec, g: torch.Generator) -> torch.Tensor:
    """Random values with a sane scale per tensor kind (activations stay O(1))."""
    name, shape = spec.name, spec.shape
    if name.endswith("norm.weight") or name.endswith("q_weight") or name.endswith("k_weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("_fn"):
        return torch.randn(shape, generator=g) * (0.5 / shape[1] ** 0.5)
    if name.endswith("attn_sink"):
        return torch.randn(shape, generator=g)
    if name.endswith("gate.bias") or name.endswith("gate.bias_vl"):
        return 0.1 * torch.randn(shape, generator=g)
    if name == "embed.weight" or spec.fmt == ENGRAM_TABLE:
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5      # linear [out, in]


def to_grid(spec, w: torch.Tensor, block: int = 32):
    """A float tensor on its V4.1 checkpoint grid, in the in-memory form."""
    if spec.fmt == FP8_32:
        q, s = Q.quantize_fp8_weight(w, block)
        return Q.dequant_fp8_weight(q, s, block).to(torch.bfloat16)
    if spec.fmt == FP4:
        q, s = Q.quantize_fp4_weight(w)
        return (q * s.repeat_interleave(32, -1)).to(torch.bfloat16)
    if spec.fmt == ENGRAM_TABLE:
        return encode_rows(w)
    if spec.fmt == BF16:
        return w.to(torch.bfloat16)
    if spec.fmt == F32:
        return w.to(torch.float32)
    raise ValueError(f"{spec.name}: unknown V4.1 format {spec.fmt!r}")


def random_weights(cfg: V41Config, seed: int = 0) -> V41Weights:
    """Deterministic random weights for any V4.1 config (same seed, same bits)."""
    g = torch.Generator().manual_seed(seed)
    return V41Weights(cfg, {s.name: to_grid(s, _init_value(s, g), cfg.weight_block_size)
                            for s in all_specs(cfg)})
