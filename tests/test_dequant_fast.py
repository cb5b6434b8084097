"""Fast bf16 dequantisation (quant.dequant_fp8_bf16 / dequant_fp4_bf16, used by
checkpoint_read.decode_fp8 / decode_fp4) against two oracles:

* `_ref_*`: a private copy of the fp32 arithmetic the decoders used before (HEAD 14e7892:
  e4m3/e2m1 -> fp32, E8M0 -> fp32 via ldexp, repeat_interleave'd scales, fp32 product,
  one rounding to bf16), so later edits of quant.py cannot move the target;
* `_hand_*`: the value worked out in Python floats (exact for these products) and rounded
  to bf16 by hand (nearest-even, subnormals, overflow to inf) — independent of torch's
  conversions.

Equality is on bit patterns (so -0.0 != +0.0), except that NaN only has to be NaN in the
same places (payloads differ between torch's scalar and vector conversions)."""
from __future__ import annotations

import math

import pytest
import torch

from reference_model import checkpoint_read as CR
from reference_model import quant as Q
from reference_model.checkpoint import decode_fp4, decode_fp8

E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn


# ---- oracle 1: today's fp32 math, copied ---------------------------------------------------
_REF_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def _ref_e8m0_to_float(b):
    if b.dtype == E8M0:
        b = b.view(torch.uint8)
    bi = b.to(torch.int32)
    out = torch.ldexp(torch.ones_like(bi, dtype=torch.float32), bi - 127)
    return torch.where(bi == 255, torch.full_like(out, float("nan")), out)


def _ref_fp8(w, scale, block=128):
    out, inp = w.shape
    s = scale.float() if scale.dtype != E8M0 else _ref_e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (w.float() * s).to(torch.bfloat16)


def _ref_fp4(packed, scale, block=32):
    b = packed.view(torch.uint8).to(torch.int64)
    vals = _REF_FP4[torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)]
    s = scale.float() if scale.dtype != E8M0 else _ref_e8m0_to_float(scale)
    return (vals * s.repeat_interleave(block, -1)[..., : vals.shape[-1]]).to(torch.bfloat16)


# ---- oracle 2: by hand ------------------------------------------------------------------------
def _hand_e4m3(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return math.nan
    v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def _hand_scale(b: int) -> float:
    return math.nan if b == 255 else 2.0 ** (b - 127)


def _hand_bf16_bits(x: float) -> int | None:
    """bf16 bit pattern of x rounded to nearest-even (None for NaN); x must be exact."""
    if math.isnan(x):
        return None
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a == 0:
        return sign
    _, e = math.frexp(a)                           # a in [2^(e-1), 2^e)
    q = max(e - 1, -126) - 7                       # bf16 quantum at a (subnormal: 2^-133)
    a = round(a / 2.0 ** q) * 2.0 ** q             # round() on floats is half-to-even
    if a >= 2.0 ** 128:
        return sign | 0x7F80
    if a < 2.0 ** -126:
        return sign | int(a / 2.0 ** -133)         # subnormal: mantissa only
    _, e = math.frexp(a)
    return sign | (e - 1 + 127) << 7 | (int(a / 2.0 ** (e - 8)) - 128)


def _hand_expected(vals: list[float], scales: list[float]) -> torch.Tensor:
    """int32 bit patterns (-1 for NaN) of bf16(v * s) for every pair."""
    out = [[-1 if (r := _hand_bf16_bits(v * s)) is None else r for v in vals] for s in scales]
    return torch.tensor(out, dtype=torch.int32)


# ---- helpers -----------------------------------------------------------------------------------
def _assert_same(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == torch.bfloat16 and want.dtype == torch.bfloat16
    assert got.shape == want.shape
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"NaN at {int((gn != wn).sum())} different places"
    g, w = got.view(torch.int16)[~gn], want.view(torch.int16)[~wn]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} bit patterns differ, first: got "
                              f"{int(g[bad[0]]) & 0xFFFF:#06x} want {int(w[bad[0]]) & 0xFFFF:#06x}")


def _bits_or_nan(t: torch.Tensor) -> torch.Tensor:
    b = t.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(torch.isnan(t), torch.full_like(b, -1), b)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The FP4 path differs by thread count (serial index_select vs row-parallel gather)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _rand_fp8(rows, cols, gen, lo=0, hi=256, nan_codes=True):
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    if not nan_codes:
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)
    sc = torch.randint(lo, hi, (-(-rows // 128), -(-cols // 128)), generator=gen,
                       dtype=torch.uint8)
    return codes.view(E4M3), sc.view(E8M0)


def _rand_fp4(rows, cols, gen, lo=0, hi=256):
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int8)
    sc = torch.randint(lo, hi, (rows, -(-cols // 32)), generator=gen, dtype=torch.uint8)
    return packed, sc.view(E8M0)


# ---- E8M0 --------------------------------------------------------------------------------------
def test_e8m0_to_bf16_every_byte():
    b = torch.arange(256, dtype=torch.uint8)
    got = Q.e8m0_to_bf16(b.view(E8M0))
    assert torch.isnan(got[255])
    want = torch.tensor([_hand_bf16_bits(_hand_scale(i)) for i in range(255)], dtype=torch.int32)
    assert torch.equal(got[:255].view(torch.int16).to(torch.int32) & 0xFFFF, want)
    assert torch.equal(Q.e8m0_to_bf16(b)[:255].float(), _ref_e8m0_to_float(b)[:255])
    # with an exponent offset: from the smallest bf16 subnormal 2^-133 to 2^127
    for off in range(-6, 121):
        top = 254 - max(off, 0)
        bits = Q.e8m0_to_bf16_bits(torch.tensor([0, 1, top, 255], dtype=torch.uint8), off)
        want = [_hand_bf16_bits(2.0 ** (v - 127 + off)) for v in (0, 1, top)]
        assert (bits[:3].to(torch.int32) & 0xFFFF).tolist() == want, off
        assert int(bits[3]) == 0x7FC0


# ---- FP8: every code under every scale byte -------------------------------------------------
@pytest.mark.parametrize("top", [255, 135, 134], ids=["all-bytes", "just-unfused", "fused-range"])
def test_fp8_every_code_under_every_scale_byte(top):
    """One 128x128 block per scale byte 0..top, each holding all 256 e4m3 codes. top >= 135
    takes the two-multiply path (2^(b-7) is not a finite bf16 for b > 134); top=134 the
    fused one. Covers subnormal codes, results that underflow to bf16 subnormals/zero,
    overflow to inf, NaN codes 0x7F/0xFF, NaN scale byte 255 and -0.0."""
    nb = top + 1
    block = torch.arange(256, dtype=torch.uint8).repeat(64).view(128, 128)
    w = block.repeat(1, nb).view(E4M3)                                  # [128, 128*nb]
    s = torch.arange(nb, dtype=torch.uint8).view(1, nb).view(E8M0)
    got = decode_fp8(w, s)
    _assert_same(got, _ref_fp8(w, s))
    want = _hand_expected([_hand_e4m3(c) for c in range(256)], [_hand_scale(b) for b in range(nb)])
    per_block = _bits_or_nan(got[:2]).view(2, nb, 128)[:, :, :].reshape(2 * nb, 128)
    # row 0 of block j holds codes 0..127, row 1 codes 128..255
    got_codes = torch.cat([per_block[:nb], per_block[nb:]], dim=1)       # [nb, 256]
    assert torch.equal(got_codes, want)


# ---- FP8: random weights, aligned and ragged shapes ------------------------------------------
FP8_SHAPES = [(4096, 4096), (1000, 777), (129, 300), (7168, 256), (1, 1), (130, 1), (255, 129),
              (128, 256), (300, 2)]


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=[f"{o}x{i}" for o, i in FP8_SHAPES])
@pytest.mark.parametrize("scales", ["all-bytes", "fused-range"])
def test_fp8_random_matches_reference(shape, scales):
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    lo, hi = (0, 256) if scales == "all-bytes" else (100, 135)
    w, s = _rand_fp8(*shape, g, lo, hi)
    want = _ref_fp8(w, s)
    _assert_same(decode_fp8(w, s), want)
    # many chunks, the last one ragged: 128-row steps
    _assert_same(Q.dequant_fp8_bf16(w, s, chunk_elems=1), want)
    _assert_same(Q.dequant_fp8_bf16(w, s, chunk_elems=384 * shape[1]), want)


def test_fp8_through_decode_chunks(monkeypatch):
    """decode_fp8's own chunking (a small chunk constant: 3 steps, the last one ragged)."""
    monkeypatch.setattr(CR, "_FAST_DECODE_CHUNK", 256 * 300)
    g = torch.Generator().manual_seed(11)
    w, s = _rand_fp8(700, 300, g)
    _assert_same(decode_fp8(w, s, device="cpu"), _ref_fp8(w, s))


# ---- FP4 ---------------------------------------------------------------------------------------
def test_fp4_every_byte_under_every_scale_byte(threads):
    """Row b: all 256 packed bytes (512 elements, 16 blocks) under scale byte b."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.int8)
    s = torch.arange(256, dtype=torch.uint8).view(256, 1).repeat(1, 16).view(E8M0)
    got = decode_fp4(packed, s)
    _assert_same(got, _ref_fp4(packed, s))
    codes = [_REF_FP4[c].item() for c in range(16)]
    want = _hand_expected([codes[c & 0xF] if j == 0 else codes[c >> 4]
                           for c in range(256) for j in range(2)],
                          [_hand_scale(b) for b in range(256)])
    assert torch.equal(_bits_or_nan(got), want)


FP4_SHAPES = [(2048, 7168), (7168, 1024), (1000, 778), (129, 300), (3, 2), (1, 34), (64, 96)]


@pytest.mark.parametrize("shape", FP4_SHAPES, ids=[f"{o}x{i}" for o, i in FP4_SHAPES])
def test_fp4_random_matches_reference(shape, threads):
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    packed, s = _rand_fp4(*shape, g)
    want = _ref_fp4(packed, s)
    _assert_same(decode_fp4(packed, s), want)
    _assert_same(Q.dequant_fp4_bf16(packed.view(torch.uint8), s, chunk_elems=1), want)
    _assert_same(Q.dequant_fp4_bf16(packed, s, chunk_elems=5 * shape[1]), want)


def test_fp4_scale_grid_wider_than_needed_is_cut():
    """As before: extra scale columns are ignored (repeat_interleave(...)[..., :in])."""
    g = torch.Generator().manual_seed(12)
    packed, s = _rand_fp4(5, 64, g)
    wide = torch.cat([s.view(torch.uint8), torch.full((5, 3), 200, dtype=torch.uint8)], 1)
    _assert_same(decode_fp4(packed, wide.view(E8M0)), _ref_fp4(packed, s))


# ---- special values, devices, fallbacks ---------------------------------------------------------
def test_nan_codes_nan_scales_and_negative_zero_in_place():
    w = torch.zeros(130, 260, dtype=torch.uint8)
    w[0, 0], w[5, 200], w[129, 259], w[3, 3], w[4, 4] = 0x7F, 0xFF, 0x7F, 0x80, 0x38
    s = torch.full((2, 3), 127, dtype=torch.uint8)
    s[1, 1] = 255                                           # rows 128.., cols 128..255
    got = decode_fp8(w.view(E4M3), s.view(E8M0))
    nan = torch.zeros(130, 260, dtype=torch.bool)
    nan[0, 0] = nan[5, 200] = nan[129, 259] = True
    nan[128:, 128:256] = True
    assert torch.equal(torch.isnan(got), nan)
    assert torch.signbit(got[3, 3]) and got[3, 3] == 0 and not torch.signbit(got[0, 1])
    assert got[4, 4].item() == 1.0


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_a_single_nan_code_alone(code):
    w = torch.full((256, 384), 0x38, dtype=torch.uint8)            # 1.0
    w[200, 300] = code
    got = decode_fp8(w.view(E4M3), torch.full((2, 3), 120, dtype=torch.uint8).view(E8M0))
    assert torch.isnan(got).sum() == 1 and torch.isnan(got[200, 300])


def test_has_e4m3_nan_every_code():
    for c in range(256):
        w = torch.full((3, 5), 0x38, dtype=torch.uint8)
        w[1, 2] = c
        assert Q.has_e4m3_nan(w.view(E4M3)) == ((c & 0x7F) == 0x7F), c
    assert not Q.has_e4m3_nan(torch.empty(0, 4, dtype=E4M3))


def test_device_and_dtype():
    g = torch.Generator().manual_seed(13)
    w, s = _rand_fp8(130, 300, g)
    for dev in (None, "cpu", torch.device("cpu")):
        d = decode_fp8(w, s, dev)
        assert d.dtype == torch.bfloat16 and d.device.type == "cpu" and d.shape == (130, 300)
    p, s4 = _rand_fp4(9, 64, g)
    d = decode_fp4(p, s4, "cpu")
    assert d.dtype == torch.bfloat16 and d.device.type == "cpu" and d.shape == (9, 64)
    assert decode_fp8(w[:0], s[:0]).shape == (0, 300)
    assert decode_fp4(p[:0], s4[:0]).shape == (0, 64)


def test_non_e8m0_scales_take_the_fp32_path():
    """fp32 scales that are not powers of two round twice (fp32 product, then bf16); the
    fast functions must reproduce exactly that."""
    g = torch.Generator().manual_seed(14)
    w, _ = _rand_fp8(200, 300, g, nan_codes=False)
    s = torch.rand(2, 3, generator=g) * 3 + 0.1
    _assert_same(decode_fp8(w, s), _ref_fp8(w, s))
    p, _ = _rand_fp4(6, 96, g)
    s4 = torch.rand(6, 3, generator=g) * 3 + 0.1
    _assert_same(decode_fp4(p, s4), _ref_fp4(p, s4))


def test_too_small_scale_grid_raises():
    g = torch.Generator().manual_seed(15)
    w, s = _rand_fp8(300, 300, g)
    with pytest.raises(ValueError):
        decode_fp8(w, s[:2])
    p, s4 = _rand_fp4(4, 64, g)
    with pytest.raises(ValueError):
        decode_fp4(p, s4[:, :1])


def test_flush_denormal_falls_back_to_reference():
    """With subnormals flushed the bit tricks would lose e4m3 subnormal codes; the fast
    functions then take the fp32 path, which gives what the reference gives in that mode."""
    g = torch.Generator().manual_seed(16)
    w, s = _rand_fp8(256, 256, g, lo=100, hi=135)
    p, s4 = _rand_fp4(8, 64, g)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert Q._flushes_subnormals(torch.device("cpu"))
        _assert_same(decode_fp8(w, s), _ref_fp8(w, s))
        _assert_same(decode_fp4(p, s4), _ref_fp4(p, s4))
    finally:
        torch.set_flush_denormal(False)
    assert not Q._flushes_subnormals(torch.device("cpu"))


def test_fp32_public_functions_unchanged():
    """dequant_fp8_weight / dequant_fp4_weight / unpack_fp4 still return today's fp32."""
    g = torch.Generator().manual_seed(17)
    w, s = _rand_fp8(129, 300, g, lo=100, hi=140, nan_codes=False)
    d = Q.dequant_fp8_weight(w, s)
    assert d.dtype == torch.float32 and torch.equal(d.to(torch.bfloat16), _ref_fp8(w, s))
    p, s4 = _rand_fp4(7, 64, g, lo=100, hi=140)
    assert torch.equal(Q.unpack_fp4(p), _REF_FP4[torch.stack(
        [p.view(torch.uint8).long() & 0xF, p.view(torch.uint8).long() >> 4], -1).flatten(-2)])
    d4 = Q.dequant_fp4_weight(p, s4)
    assert d4.dtype == torch.float32 and torch.equal(d4.to(torch.bfloat16), _ref_fp4(p, s4))
