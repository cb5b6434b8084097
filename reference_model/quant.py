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
