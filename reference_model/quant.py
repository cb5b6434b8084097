"""Quantisation grids of DeepSeek-V4 (research §3.2, §4.1, §4.2): FP8 e4m3 block QDQ with
power-of-two (E8M0) scales, FP4 e2m1 block QDQ, E8M0 bytes and packed FP4 nibbles.

All QDQ functions take any float tensor and return fp32 values on the grid; the caller
decides the storage dtype. Blocks run along the last dimension."""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
# The reference multiplies by an fp32 reciprocal (not a division); it matters exactly at
# amax = 448·2^k, where the rounded reciprocal decides the binade.
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_INV_FP4_MAX = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)

# e2m1 code -> value; bit 3 is the sign (so code 8 is -0.0).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive fp32 v, exactly (via frexp, no log rounding)."""
    m, e = torch.frexp(v.float())
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e)


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """E8M0 scale byte b (uint8 or float8_e8m0fnu) -> 2^(b-127) as fp32 (b=255 is NaN)."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    bi = b.to(torch.int32)
    out = torch.ldexp(torch.ones_like(bi, dtype=torch.float32), bi - 127)
    return torch.where(bi == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> E8M0 bytes (uint8). Raises on non-powers of two."""
    m, e = torch.frexp(s.float())
    if not bool(((m == 0.5) & (s > 0)).all()):
        raise ValueError("E8M0 can only hold positive powers of two")
    return (e - 1 + 127).clamp(0, 254).to(torch.uint8)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the block size {block}")
    return x.float().unflatten(-1, (n // block, block))


def fp8_block_scales(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """Per-block scale of `act_quant`: amax floored at 1e-4, times fp32(1/448), rounded up to
    a power of two when `pow2` (ue8m0); shape [..., n/block]."""
    amax = _blocks(x, block).abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)
    s = amax * _INV_FP8_MAX.to(amax.device)
    return pow2_ceil(s) if pow2 else s


def fp8_qdq(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise in 1×`block` blocks (reference `act_quant`)."""
    xb = _blocks(x, block)
    s = fp8_block_scales(x, block, pow2).unsqueeze(-1)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)


def fp8_quantize(x: torch.Tensor, block: int, pow2: bool = True):
    """(e4m3 codes, fp32 scales [..., n/block]) — the non-in-place `act_quant`."""
    xb = _blocks(x, block)
    s = fp8_block_scales(x, block, pow2)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the e2m1 grid, nearest with ties to the even code."""
    a = v.abs()
    # midpoints between grid values; ties go to the even code (value with mantissa bit 0)
    # grid 0 .5 1 1.5 2 3 4 6 ; codes 0..7 ; even codes: 0, 1.0, 2.0, 4.0
    r = torch.zeros_like(a)
    r = torch.where(a > 0.25, torch.full_like(a, 0.5), r)
    r = torch.where(a >= 0.75, torch.full_like(a, 1.0), r)
    r = torch.where(a > 1.25, torch.full_like(a, 1.5), r)
    r = torch.where(a >= 1.75, torch.full_like(a, 2.0), r)
    r = torch.where(a > 2.5, torch.full_like(a, 3.0), r)
    r = torch.where(a >= 3.5, torch.full_like(a, 4.0), r)
    r = torch.where(a > 5.0, torch.full_like(a, 6.0), r)
    return torch.copysign(r, v)


def fp4_block_scales(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    amax = _blocks(x, block).abs().amax(-1).clamp_min(FP4_AMAX_FLOOR)
    return pow2_ceil(amax * _INV_FP4_MAX.to(amax.device))


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise in 1×`block` blocks with E8M0 scales (`fp4_act_quant`)."""
    xb = _blocks(x, block)
    s = fp4_block_scales(x, block).unsqueeze(-1)
    return (round_to_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2)


# ---- weight formats (checkpoint side) ---------------------------------------------------
def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """W[o,i] = e4m3(W)[o,i] · scale[o//128, i//128]; handles shapes that are not multiples
    of the block (the scale grid is ceil(out/128) × ceil(in/128))."""
    out, inp = w.shape
    s = scale.float() if scale.dtype != torch.float8_e8m0fnu else e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return w.float() * s


def quantize_fp8_weight(w: torch.Tensor, block: int = 128):
    """fp32 weight -> (e4m3 [out,in], E8M0-valued fp32 scales [ceil(out/b), ceil(in/b)])."""
    out, inp = w.shape
    po, pi = -out % block, -inp % block
    wp = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    blocks = wp.unflatten(0, (-1, block)).unflatten(2, (-1, block))      # [O, b, I, b]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_ceil(amax * _INV_FP8_MAX)
    se = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    q = (w.float() / se).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [out, in/2] -> fp32 e2m1 values [out, in]; low nibble is element 2j."""
    b = packed.view(torch.uint8).to(torch.int64)
    lo, hi = b & 0xF, b >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    return FP4_VALUES.to(packed.device)[codes]


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """fp32 values already on the e2m1 grid [out, in] -> int8 [out, in/2] (low nibble first)."""
    a = values.abs()
    grid = FP4_VALUES[:8].to(values.device)
    mag = (a.unsqueeze(-1) == grid).float().argmax(-1)
    if not bool((grid[mag] == a).all()):
        raise ValueError("pack_fp4: values are not on the e2m1 grid")
    codes = mag | (torch.signbit(values).to(torch.int64) << 3)
    codes = codes.unflatten(-1, (-1, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = unpack_fp4(packed)
    s = scale.float() if scale.dtype != torch.float8_e8m0fnu else e8m0_to_float(scale)
    return vals * s.repeat_interleave(block, -1)[..., : vals.shape[-1]]


def quantize_fp4_weight(w: torch.Tensor, block: int = 32):
    """fp32 weight -> (e2m1 values [out,in] fp32, E8M0-valued fp32 scales [out, in/32])."""
    s = fp4_block_scales(w, block)
    q = round_to_e2m1((_blocks(w, block) / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return q.flatten(-2), s
