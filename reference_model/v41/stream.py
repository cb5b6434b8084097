"""The residual stream V4.1 passes between layers: the four copies H and the lagged pre-mix P.

V4.1's mHC is lagged (doc §5.3): each site collapses its input with the previous site's
pre-mix, so layer l+1 (and the head) need P_{l+1} = layer l's FFN pre-mix alongside H. Tools
drive the model layer-major and hold the stream between layers (the lockstep's stream store,
pipeline send/recv, the chunked head slicing positions), so P travels inside the stream
tensor: each stream row k carries P_k's bytes in a few extra trailing channels.

    H [n, hc, dim] in the storage dtype + P [n, hc] (fp32 in the reference profile: the
    reference keeps it fp32) -> one tensor [n, hc, dim + slots] in the storage dtype.

Bytes are copied, never converted, so P survives bf16 storage bit for bit; positions stay
on dim 0, so slicing positions (the head run a chunk at a time) slices both."""
from __future__ import annotations

import torch


def pre_dtype(sd: torch.dtype) -> torch.dtype:
    """The dtype P is kept in: fp32 under a narrower storage dtype, else the storage dtype."""
    return torch.float32 if torch.finfo(sd).bits < 32 else sd


def slots(sd: torch.dtype) -> int:
    """Trailing channels per stream row that hold P_k's bytes."""
    return torch.finfo(pre_dtype(sd)).bits // torch.finfo(sd).bits


def pack(H: torch.Tensor, P: torch.Tensor, sd: torch.dtype) -> torch.Tensor:
    """[n, hc, dim] streams and [n, hc] pre-mix -> one [n, hc, dim + slots] tensor in `sd`."""
    n, hc, _ = H.shape
    if P.shape != (n, hc):
        raise ValueError(f"pre-mix shape {tuple(P.shape)} does not fit streams {tuple(H.shape)}")
    p = P.to(pre_dtype(sd)).contiguous().view(sd).view(n, hc, slots(sd))
    return torch.cat([H.to(sd), p.to(H.device)], -1)


def unpack(S: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H [n, hc, dim] in the stream's dtype, P [n, hc] in its keeping dtype) from a packed
    stream; a tensor of the wrong width is a named error (a V4 stream given to V4.1)."""
    sd = S.dtype
    k = slots(sd)
    if S.dim() != 3 or S.shape[-1] != dim + k:
        raise ValueError(f"a DeepSeek-V4.1 residual stream is [tokens, hc, {dim} + {k}] "
                         f"(streams + lagged pre-mix), got {tuple(S.shape)}")
    n, hc, _ = S.shape
    P = S[..., dim:].contiguous().view(pre_dtype(sd)).view(n, hc)
    return S[..., :dim], P
