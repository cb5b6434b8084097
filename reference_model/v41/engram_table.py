"""V4.1's Engram tables in checkpoint form (docs/v41-architecture.md §6): e4m3 codes with one
E8M0 scale per 32 channels, kept on the host and gathered row by row, because the release's
are ~94 GiB each (two layers) and a token needs 24 rows of each."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant as Q

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
