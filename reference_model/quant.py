"""Quantisation grids of DeepSeek-V4 (docs/research/dsv4-architecture.md §3.2, §4.1, §4.2): FP8 e4m3 block QDQ with
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


def tracks_grad(*ts) -> bool:
    """Whether autograd records through any of these tensors (QAT trains through the
    reference numerics: the in-place and table fast paths then step aside)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in ts)


def fp8_qdq(x: torch.Tensor, block: int, pow2: bool = True,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise in 1×`block` blocks (reference `act_quant`): fp32 grid
    values, returned as `dtype`. Under autograd the casts pass the gradient straight
    through."""
    xf = x.float()                              # one fp32 copy, shared with the scales
    xb = _blocks(xf, block)
    s = fp8_block_scales(xf, block, pow2).unsqueeze(-1)
    if tracks_grad(x, s):
        q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return (q * s).flatten(-2).to(dtype)
    q = (xb / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # fp64 straight from the codes: code·s is exact in fp32 when s is a power of two with
    # 448·s below the fp32 maximum (every product is then a normal fp32: s >= 2^-22 by the
    # amax floor), so the fp64 product is the same value without an fp32 pass
    if (dtype == torch.float64 and pow2 and q.device.type == "cpu" and s.numel()
            and bool(s.max() <= 2.0 ** 119)):
        return e4m3_to_float(q, torch.float64).mul_(s.double()).flatten(-2)
    return e4m3_to_float(q).mul_(s).flatten(-2).to(dtype)


# e4m3fn code byte -> its value, every code (NaN codes 0x7F/0xFF included) as torch's own
# cast gives it; torch's e4m3 -> fp32 cast is scalar code on CPU, a table gather is ~4x
# faster (tests/test_reference_speed_identity.py checks the table against the cast).
_E4M3_TABLES = {torch.float32: torch.arange(256, dtype=torch.int32).to(torch.uint8)
                .view(torch.float8_e4m3fn).float()}
_E4M3_TABLES[torch.float64] = _E4M3_TABLES[torch.float32].double()


def e4m3_to_float(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn -> fp32 (or fp64), equal bit for bit to `q.to(dtype)`."""
    if q.device.type != "cpu" or dtype not in _E4M3_TABLES:
        return q.to(dtype)
    idx = q.reshape(-1).view(torch.uint8).to(torch.int32)
    return _E4M3_TABLES[dtype].index_select(0, idx).view(q.shape)


def fp8_quantize(x: torch.Tensor, block: int, pow2: bool = True):
    """(e4m3 codes, fp32 scales [..., n/block]) — the non-in-place `act_quant`."""
    xb = _blocks(x, block)
    s = fp8_block_scales(x, block, pow2)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


# e2m1 magnitudes by code, and the midpoints between neighbours. Ties go to the even code
# (value with mantissa bit 0: 0, 1.0, 2.0, 4.0), so |v| rounds up past 0.25, 1.25, 2.5 and
# 5.0 only when strictly above them, and past 0.75, 1.75, 3.5 when at or above them.
_E2M1_GRID = FP4_VALUES[:8]
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def _e2m1_edges(dtype: torch.dtype, device) -> torch.Tensor:
    """Thresholds t_i with code(|v|) = #{i: |v| > t_i}: the midpoints, with each tie-up
    midpoint replaced by the next value below it in `dtype` (|v| >= m <=> |v| > prev(m))."""
    m = torch.tensor(_E2M1_MIDPOINTS, dtype=dtype, device=device)
    up = torch.tensor(_E2M1_TIE_UP, device=device)
    return torch.where(up, torch.nextafter(m, torch.zeros_like(m)), m)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the e2m1 grid, nearest with ties to the even code
    (beyond ±6: ±6; NaN: a zero with NaN's sign). The code is a count of thresholds passed,
    then one table gather (tests/test_reference_speed_identity.py compares it with the
    midpoint-by-midpoint rule; every fp32 value was checked once, bench/results/reference_speed.md)."""
    a = v.abs()
    code = None
    for t in _e2m1_edges(v.dtype, v.device).tolist():      # exact in v's dtype
        hit = (a > t).view(torch.uint8)                     # NaN passes none: code 0
        code = hit if code is None else code.add_(hit)
    r = _E2M1_GRID.to(device=v.device, dtype=v.dtype).index_select(0, code.reshape(-1).int())
    return torch.copysign(r.view(v.shape), v)


def fp4_block_scales(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    amax = _blocks(x, block).abs().amax(-1).clamp_min(FP4_AMAX_FLOOR)
    return pow2_ceil(amax * _INV_FP4_MAX.to(amax.device))


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise in 1×`block` blocks with E8M0 scales (`fp4_act_quant`)."""
    xf = x.float()                              # one fp32 copy, shared with the scales
    xb = _blocks(xf, block)
    s = fp4_block_scales(xf, block).unsqueeze(-1)
    if tracks_grad(x, s):
        return (round_to_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2)
    return round_to_e2m1((xb / s).clamp_(-FP4_MAX, FP4_MAX)).mul_(s).flatten(-2)



def nvfp4_qdq(x: torch.Tensor, block: int = 16, global_scale: float = 1.0) -> torch.Tensor:
    """NVFP4 quantise-dequantise in 1x`block` blocks (fp32 out): e2m1 values times an e4m3
    block scale (amax / 6 / global_scale, rounded to nearest: values above 6 times it
    saturate, as NVFP4 quantisers clamp; an all-zero block keeps 1) times `global_scale`."""
    xf = x.float()
    xb = _blocks(xf, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = (amax * _INV_FP4_MAX.to(amax.device) / global_scale).to(torch.float8_e4m3fn).float() * global_scale
    s = torch.where(s > 0, s, torch.ones_like(s))
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


# ---- fast bf16 dequantisation (checkpoint decode) -------------------------------------------
# `dequant_fp8_bf16` / `dequant_fp4_bf16` return exactly `dequant_*_weight(...).to(bfloat16)`
# (same bits; NaN in the same places) without fp32 temporaries or expanded scale tensors,
# a row chunk at a time, writing each result element once:
#   FP8: the e4m3 byte s.eeee.mmm becomes the bf16 bit pattern s.0000eeee.mmm0000, which is
#        the e4m3 value times 2^-120 exactly (e4m3 subnormals land on bf16 subnormals), then
#        one bf16 multiply by the power of two 2^(k+120) per 128x128 block (broadcast view;
#        if some 2^(k+120) is not a finite bf16, i.e. a scale byte above 134, first by 2^120
#        and then by 2^k). torch multiplies bf16 in fp32, where the product of the two exact
#        operands is exact (at most 4 significant bits, never below 2^-149), and rounds it
#        once to bf16, as the fp32 reference rounds its own (identical) product. Codes
#        0x7F/0xFF are then set to NaN.
#   FP4: one gather per packed byte from a [256 scale bytes x 256 packed bytes] table of
#        bf16 pairs whose entries are computed by the fp32 reference arithmetic itself.
# Both need the FPU to keep subnormals (torch.set_flush_denormal(False), the default); when
# it flushes them they fall back to the fp32 reference path.
_INT16_0x87FF = 0x87FF - 0x10000          # keep sign (bit 15) and bits 4..10
_BF16_NAN_BITS = 0x7FC0
_FP4_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}
DEQUANT_CHUNK_ELEMS = 1 << 21             # output elements per step (bounds the scratch)


def e8m0_to_bf16_bits(b: torch.Tensor, exp_offset: int = 0) -> torch.Tensor:
    """E8M0 bytes -> int16 bit patterns of bf16 2^(b-127+exp_offset) (byte 255 -> NaN).
    Every other byte needs b-127+exp_offset in [-133, 127] (bf16 powers of two; subnormal
    below 2^-126)."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    e = b.to(torch.int32) + exp_offset              # biased bf16 exponent when >= 1
    normal = e.clamp(1, 254) << 7
    sub = torch.ones_like(e) << (e + 6).clamp(0, 6)     # 2^(e-127) = 2^(e+6) * 2^-133
    bits = torch.where(e >= 1, normal, sub)
    bits = torch.where(b == 255, torch.full_like(bits, _BF16_NAN_BITS), bits)
    return bits.to(torch.int16)


def e8m0_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """E8M0 scale byte -> bf16 2^(b-127), exact for every byte (0 -> 2^-127, a bf16
    subnormal; 255 -> NaN)."""
    return e8m0_to_bf16_bits(b).view(torch.bfloat16)


def has_e4m3_nan(w: torch.Tensor) -> bool:
    """Whether an e4m3fn tensor (or its raw bytes) holds a NaN code 0x7F/0xFF: its max as
    uint8 is 255 or its max as int8 is 127. Two plain reductions (~0.5 ms for 14.7 MB on one
    thread here), ~50x cheaper than `((w.view(uint8) & 0x7F) == 0x7F).any()`, which builds
    a bool tensor."""
    u = w.view(torch.uint8)
    return u.numel() > 0 and bool((u.amax() == 255) | (u.view(torch.int8).amax() == 127))


def _flushes_subnormals(device: torch.device) -> bool:
    """Whether float arithmetic on `device` (this thread) flushes subnormals, e.g. after
    torch.set_flush_denormal(True): 2^-127 * 2 must be 2^-126."""
    x = torch.tensor([0x0040], dtype=torch.int16, device=device).view(torch.bfloat16)
    return int((x * 2.0).view(torch.int16)[0]) != 0x0080


def _mul_block_scales(x: torch.Tensor, s: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out[o, i] = x[o, i] * s[o // block, i // block] for 2-D x/out and the block grid s,
    through broadcast views (the aligned bulk as [O/b, b, I/b, b] * [O/b, 1, I/b, 1]; no
    expanded scale tensor); a ragged last row/column block is a separate view."""
    rows, cols = x.shape
    ra, ca = rows - rows % block, cols - cols % block
    nr, nc = ra // block, ca // block

    def blocks(t, r0, r1, c0, c1):
        t = t[r0:r1, c0:c1]
        if c1 - c0 == nc * block and nc:
            t = t.unflatten(1, (nc, block))
        return t.unflatten(0, (nr, block)) if r1 - r0 == nr * block and nr else t

    if ra and ca:
        torch.mul(blocks(x, 0, ra, 0, ca), s[:nr, None, :nc, None], out=blocks(out, 0, ra, 0, ca))
    if ra and ca < cols:
        torch.mul(blocks(x, 0, ra, ca, cols), s[:nr, None, nc:nc + 1],
                  out=blocks(out, 0, ra, ca, cols))
    if ra < rows and ca:
        torch.mul(blocks(x, ra, rows, 0, ca), s[nr, :nc, None], out=blocks(out, ra, rows, 0, ca))
    if ra < rows and ca < cols:
        torch.mul(x[ra:, ca:], s[nr, nc], out=out[ra:, ca:])


def _chunk_rows(cols: int, chunk_elems: int, multiple: int) -> int:
    return max(multiple, (chunk_elems // max(cols, 1)) // multiple * multiple)


def dequant_fp8_bf16(w: torch.Tensor, scale: torch.Tensor, block: int = 128, device=None,
                     chunk_elems: int = DEQUANT_CHUNK_ELEMS) -> torch.Tensor:
    """e4m3 [out,in] + E8M0 scales [ceil(out/block), ceil(in/block)] -> bf16 [out,in] on
    `device` (default: w's), bit-identical to `dequant_fp8_weight(w, scale).to(bfloat16)`.
    Works in row chunks of about `chunk_elems` elements (each moved to `device` on its own)
    through one reused int16 scratch chunk; the result is written once, by the scale
    multiply. Other dtypes (e.g. fp32 scales) take the fp32 reference path, chunk by chunk,
    as does an FPU that flushes subnormals."""
    device = torch.device(device) if device is not None else w.device
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    step = _chunk_rows(cols, chunk_elems, block)
    if (w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu
            or _flushes_subnormals(device)):
        for a in range(0, rows, step):
            b = min(a + step, rows)
            s = scale[a // block: -(-b // block)].to(device)
            out[a:b] = dequant_fp8_weight(w[a:b].to(device), s, block).to(torch.bfloat16)
        return out
    nr, nc = -(-rows // block), -(-cols // block)
    sb = scale.view(torch.uint8)[:nr, :nc].to(device)
    if tuple(sb.shape) != (nr, nc):
        raise ValueError(f"dequant_fp8_bf16: scale grid {tuple(scale.shape)} is smaller than "
                         f"{nr}x{nc} for a {rows}x{cols} weight")
    if out.numel() == 0:
        return out
    finite = torch.where(sb == 255, torch.zeros_like(sb), sb)
    fused = int(finite.amax()) <= 134               # 2^(b-127+120) is a finite bf16
    s = e8m0_to_bf16_bits(sb, 120 if fused else 0).view(torch.bfloat16)
    w8 = w.view(torch.int8)
    scratch = torch.empty(min(step, rows) * cols, dtype=torch.int16, device=device)
    nan_flags = []
    for a in range(0, rows, step):
        b = min(a + step, rows)
        src = w8[a:b].to(device)
        t = scratch[:(b - a) * cols].view(b - a, cols)
        t.copy_(src)                              # sign-extended: s -> bits 7..15
        nan_flags += [src.amax(), src.view(torch.uint8).amax()]     # e4m3 NaN 0x7F / 0xFF
        t.bitwise_left_shift_(4)
        t.bitwise_and_(_INT16_0x87FF)             # s.0000eeee.mmm0000 = e4m3 value * 2^-120
        x = t.view(torch.bfloat16)
        if not fused:                             # undo the 2^-120 first (exact)
            x.mul_(2.0 ** 120)
        _mul_block_scales(x, s[a // block: -(-b // block)], block, out[a:b])
    flags = torch.stack(nan_flags).view(-1, 2)
    if bool(((flags[:, 0] == 127) | (flags[:, 1] == 255)).any()):
        for a in range(0, rows, step):
            b = min(a + step, rows)
            nan = (w[a:b].view(torch.uint8).to(device) & 0x7F) == 0x7F
            # 0xFFFF: the NaN torch's vectorised fp32 -> bf16 conversion (the reference's
            # on CPU) produces
            out[a:b].view(torch.int16).masked_fill_(nan, -1)
    return out


def _fp4_pair_table(device: torch.device) -> torch.Tensor:
    """int32 [256*256]: entry sbyte*256 + byte holds the bf16 bits of element 2j (low half;
    the low nibble) and element 2j+1 (high half; the high nibble) of packed byte `byte` under
    scale byte `sbyte`, computed as `dequant_fp4_weight(...).to(bfloat16)` computes them
    (fp32 product, one rounding to bf16)."""
    tab = _FP4_PAIR_TABLES.get(device)
    if tab is None:
        byte = torch.arange(256)
        s = e8m0_to_float(torch.arange(256, dtype=torch.uint8))[:, None]        # [scale, 1]
        lo = (FP4_VALUES[byte & 0xF][None, :] * s).to(torch.bfloat16).view(torch.int16)
        hi = (FP4_VALUES[byte >> 4][None, :] * s).to(torch.bfloat16).view(torch.int16)
        tab = (hi.to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)
        tab = tab.reshape(-1).to(device)
        _FP4_PAIR_TABLES[device] = tab
    return tab


def dequant_fp4_bf16(packed: torch.Tensor, scale: torch.Tensor, block: int = 32, device=None,
                     chunk_elems: int = DEQUANT_CHUNK_ELEMS) -> torch.Tensor:
    """int8/uint8 [out, in/2] packed e2m1 (low nibble = element 2j) + E8M0 scales
    [out, ceil(in/block)] -> bf16 [out, in] on `device` (default: packed's), bit-identical to
    `dequant_fp4_weight(packed, scale, block).to(bfloat16)`. Works in row chunks of about
    `chunk_elems` output elements: table index = scale byte * 256 + packed byte (int32), then
    one gather per byte straight into the result. Other dtypes take the fp32 reference path,
    as does an FPU that flushes subnormals."""
    device = torch.device(device) if device is not None else packed.device
    rows, half = packed.shape
    cols = 2 * half
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    step = _chunk_rows(cols, chunk_elems, 1)
    if (packed.dtype not in (torch.int8, torch.uint8) or scale.dtype != torch.float8_e8m0fnu
            or block % 2 or _flushes_subnormals(device)):
        for a in range(0, rows, step):
            b = min(a + step, rows)
            out[a:b] = dequant_fp4_weight(packed[a:b].to(device), scale[a:b].to(device),
                                          block).to(torch.bfloat16)
        return out
    ng = -(-cols // block)
    if scale.dim() != 2 or scale.shape[0] != rows or scale.shape[1] < ng:
        raise ValueError(f"dequant_fp4_bf16: scale {tuple(scale.shape)} does not cover "
                         f"[{rows}, {ng}] for a [{rows}, {cols}] weight")
    if out.numel() == 0:
        return out
    tab = _fp4_pair_table(device)
    out32 = out.view(torch.int32)                 # [rows, half]: one bf16 pair per byte
    bh = block // 2                               # packed bytes per scale block
    full = half // bh
    # index_select's CPU kernel for a 1-D table is serial (and the fastest on one thread);
    # with more threads a row-parallel gather over the expanded table (int64 index) wins
    par = device.type == "cpu" and torch.get_num_threads() > 1
    n_max = min(step, rows) * half
    idx_buf = torch.empty(n_max, dtype=torch.int32, device=device)
    idx64_buf = torch.empty(n_max, dtype=torch.int64, device=device) if par else None
    bias_all = scale[:, :ng].view(torch.uint8).to(device).to(torch.int32) << 8    # table rows
    for a in range(0, rows, step):
        b = min(a + step, rows)
        n = (b - a) * half
        idx = idx_buf[:n].view(b - a, half)
        idx.copy_(packed[a:b].view(torch.uint8).to(device))
        bias = bias_all[a:b]
        if full:
            idx[:, :full * bh].unflatten(1, (full, bh)).add_(bias[:, :full, None])
        if full * bh < half:
            idx[:, full * bh:].add_(bias[:, full:full + 1])
        if par:
            idx64 = idx64_buf[:n].view(b - a, half)
            idx64.copy_(idx)
            torch.gather(tab.expand(b - a, tab.numel()), 1, idx64, out=out32[a:b])
        else:
            torch.index_select(tab, 0, idx.view(-1), out=out32[a:b].view(-1))
    return out


def dequant_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                  block: int = 16) -> torch.Tensor:
    """NVIDIA ModelOpt NVFP4 [out, in/2] uint8 (low nibble = element 2j, e2m1) with e4m3
    scales per `block` inputs and one fp32 global scale -> fp32 [out, in]:
    W = e2m1 · float(block_scale) · global_scale (docs/weight-formats.md §4.2)."""
    vals = unpack_fp4(packed)
    s = block_scale.float().repeat_interleave(block, -1)[..., : vals.shape[-1]]
    return (vals * s) * global_scale.float()
