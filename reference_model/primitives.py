"""Small numerical primitives of the reference forward: RMSNorm in the reference's cast
order, the normalised Walsh–Hadamard matrix, RoPE tables (per-layer-type theta, YaRN
without amplitude factor) and interleaved partial RoPE with its inverse (docs/research/dsv4-architecture.md §4.4–4.6),
mHC's Sinkhorn split and the deterministic top-k (shared by V4's and V4.1's kernels).

Functions take a `round_fn` where the reference rounds to bf16, so the same code serves the
`reference` profile (bf16 rounding) and the `exact` profile (identity)."""
from __future__ import annotations

import functools
import math

import torch

from .quant import tracks_grad


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             compute_dtype=torch.float32) -> torch.Tensor:
    """w · (x · rsqrt(mean(x²) + eps)), all in compute dtype; the caller casts once after.
    (HF-style "cast the normalised x to bf16, then multiply by w" differs by one rounding.)"""
    xf = x.to(compute_dtype)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(compute_dtype)


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:                                   # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_matrix(n: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Normalised Sylvester (natural-order) Walsh–Hadamard matrix, H·Hᵀ = I."""
    return _hadamard_cpu(n).to(dtype=dtype, device=device)


def hadamard(x: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """`rotate_activation`: x @ H/sqrt(d) on the last dim (H is symmetric)."""
    return x.to(compute_dtype) @ hadamard_matrix(x.shape[-1], compute_dtype, x.device)


# ---- RoPE -----------------------------------------------------------------------------
def rope_inv_freq(rope_dim: int, base: float, factor: float = 1.0, original_seq_len: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0,
                  dtype=torch.float32) -> torch.Tensor:
    """Per-pair frequencies of `precompute_freqs_cis` (fp32 like the reference, or fp64 for
    the exact profile); YaRN when original_seq_len > 0. YaRN here only re-mixes
    frequencies: no mscale, amplitude stays exactly 1."""
    i = torch.arange(0, rope_dim, 2, dtype=dtype)
    freqs = 1.0 / (base ** (i / rope_dim))
    if original_seq_len > 0:
        def corr_dim(rot):
            return rope_dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """complex [n, rope_dim/2]: polar(1, t·f), angles in inv_freq's dtype (fp32 in the reference)."""
    ang = torch.outer(positions.to(inv_freq.dtype), inv_freq)
    return torch.polar(torch.ones_like(ang), ang)


def apply_rope(x: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST table.shape[-1]*2 dims of x as adjacent (interleaved) pairs.
    x [..., n, (heads,) d]; table [n, r/2] broadcast over the head axis if x has one.
    Returns a new tensor in x's dtype; the rotation itself is computed in fp32 (or fp64)."""
    r = table.shape[-1] * 2
    return torch.cat([x[..., :-r], rope_rotate(x[..., -r:], table, inverse)], dim=-1)


def rope_rotate(tail: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The rotated dims alone: `tail` holds exactly the 2·table.shape[-1] rotated dims;
    computed in fp32 (fp64 for fp64 input), returned in tail's dtype."""
    cd = torch.float64 if tail.dtype == torch.float64 else torch.float32
    t = table.to(torch.complex128 if cd == torch.float64 else torch.complex64)
    if inverse:
        t = t.conj()
    while t.dim() < tail.dim():
        t = t.unsqueeze(-2)
    z = torch.view_as_complex(tail.to(cd).unflatten(-1, (-1, 2)).contiguous()) * t
    return torch.view_as_real(z).flatten(-2).to(tail.dtype)


# below this many tokens (a decode step) the plain normalisations take half the torch calls
# of the streams-last ones, and per-call overhead is all there is
STREAMS_LAST_MIN_TOKENS = 16


def sinkhorn_split(mixes, scale, base, hc: int, iters: int, eps: float):
    """`hc_split_sinkhorn` (docs/research/dsv4-architecture.md §4.8): pre = sigmoid + eps, post = 2·sigmoid,
    comb = softmax(rows) + eps, one column normalisation, then iters-1 row/column pairs.
    comb[.., j, k]: j = source stream, k = destination."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]
    c = c.unflatten(-1, (hc, hc))
    c = torch.softmax(c, dim=-1) + eps
    if (2 <= hc <= 4 and c.device.type == "cpu" and not tracks_grad(c)
            and c.numel() >= STREAMS_LAST_MIN_TOKENS * hc * hc):
        return pre, post, _sinkhorn_streams_last(c, iters, eps)
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def _sinkhorn_streams_last(c, iters: int, eps: float):
    """The normalisations of sinkhorn_split with the tokens as the last, contiguous axis
    ([hc, hc, n]), so every step is a whole-vector op instead of a reduction over 4
    elements. torch sums 2-4 elements left to right (tests/test_reference_speed_identity.py
    checks it), so the explicit left-to-right sums here are the same values."""
    shape = c.shape
    t = c.reshape(-1, *shape[-2:]).permute(1, 2, 0).contiguous()       # [j, k, n]

    def col_norm():                                  # c / (sum over j + eps)
        s = t[0] + t[1]
        for j in range(2, t.shape[0]):
            s = s + t[j]
        t.div_((s + eps).unsqueeze(0))

    def row_norm():                                  # c / (sum over k + eps)
        s = t[:, 0] + t[:, 1]
        for k in range(2, t.shape[1]):
            s = s + t[:, k]
        t.div_((s + eps).unsqueeze(1))

    col_norm()
    for _ in range(iters - 1):
        row_norm()
        col_norm()
    return t.permute(2, 0, 1).reshape(shape).contiguous()


def topk_lowest_index_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-k set per row: everything above the k-th value, then the
    lowest-index entries equal to it. Indices come back in ascending position order (the
    set is what matters to attention); -1 marks picks whose score is -inf (not visible)."""
    # a NaN score can never be selected; (nan_to_num alone would also turn -inf into the
    # finite dtype minimum, and invisible picks would no longer come back as -1)
    scores = scores.masked_fill(scores.isnan(), float("-inf"))
    n = scores.shape[-1]
    k = min(k, n)
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    cut = torch.topk(scores, k, dim=-1).values[..., -1:]
    gt = scores > cut
    eq = scores == cut
    need = k - gt.sum(-1, keepdim=True)
    sel = gt | (eq & (eq.cumsum(-1) <= need))
    pos = torch.arange(n, device=scores.device).expand_as(scores)
    idx = torch.masked_select(pos, sel).view(*scores.shape[:-1], k)
    picked = torch.gather(scores, -1, idx)
    return torch.where(torch.isneginf(picked), torch.full_like(idx, -1), idx)


def topk_highest_index_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The same top-k set rule with exact ties broken towards the HIGHER index: the other
    tie order torch.topk may legally use. Running it as an arm measures what tie order
    alone does to the selection (a floor for indexer signals)."""
    n = scores.shape[-1]
    idx = topk_lowest_index_ties(scores.flip(-1), k)
    return torch.where(idx >= 0, n - 1 - idx, idx).flip(-1)
