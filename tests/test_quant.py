"""Quantisation grids (docs/research/dsv4-architecture.md §3.2, §4.1, §4.2) against independent re-derivations:
the e4m3 / e2m1 grids are enumerated here from their bit layouts, rounding is done in exact
rational arithmetic, and fp32 scale arithmetic is reproduced with numpy float32."""
from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from reference_model import quant as Q


# ---- independent grids --------------------------------------------------------------------
def e4m3_grid() -> list[tuple[Fraction, int]]:
    """All finite non-negative e4m3fn magnitudes with their 7-bit codes, from the bit layout:
    4 exponent bits (bias 7), 3 mantissa bits, exp=15 & mant=7 is NaN, no infinities."""
    out = []
    for code in range(128):
        e, m = code >> 3, code & 7
        if e == 15 and m == 7:
            continue
        if e == 0:
            v = Fraction(m, 8) * Fraction(1, 2 ** 6)
        else:
            v = (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
        out.append((v, code))
    return sorted(out)


def e2m1_grid() -> list[tuple[Fraction, int]]:
    """Non-negative e2m1 magnitudes and codes: 2 exponent bits (bias 1), 1 mantissa bit."""
    out = []
    for code in range(8):
        e, m = code >> 1, code & 1
        v = Fraction(m, 2) if e == 0 else (1 + Fraction(m, 2)) * Fraction(2) ** (e - 1)
        out.append((v, code))
    return sorted(out)


E4M3 = e4m3_grid()
E2M1 = e2m1_grid()


def round_grid(x: float, grid, vmax: Fraction) -> float:
    """Nearest grid value to x after clamping to ±vmax; ties go to the even code."""
    a = min(abs(Fraction(x)), vmax)
    vals = [v for v, _ in grid]
    j = bisect.bisect_left(vals, a)
    if j < len(vals) and vals[j] == a:
        r = vals[j]
    else:
        (lo, clo), (hi, chi) = grid[j - 1], grid[j]
        dl, dh = a - lo, hi - a
        r = lo if dl < dh else hi if dh < dl else (lo if clo % 2 == 0 else hi)
    return math.copysign(float(r), x)


def f32(x) -> float:
    return float(np.float32(x))


def pow2_ceil_exact(v: float) -> float:
    """Smallest power of two >= v (v > 0), by exact comparison."""
    k = math.floor(math.log2(v)) - 2
    while Fraction(2) ** k < Fraction(v):
        k += 1
    return float(Fraction(2) ** k)


def fp8_scale_ref(block_vals, pow2=True) -> float:
    amax = max(max(abs(float(v)) for v in block_vals), f32(1e-4))
    s = f32(np.float32(amax) * np.float32(1.0 / 448.0))    # fp32 product with fp32 reciprocal
    return pow2_ceil_exact(s) if pow2 else s


def _blockwise_ref(x: torch.Tensor, block: int, qdq_block) -> torch.Tensor:
    """Apply `qdq_block(list of floats) -> list` to each 1×block block of each row."""
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    out = [[v for b in range(0, len(row), block) for v in qdq_block(row[b:b + block])] for row in rows]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def fp8_qdq_ref(x: torch.Tensor, block: int, pow2=True) -> torch.Tensor:
    def qdq(blk):
        s = fp8_scale_ref(blk, pow2)
        return [round_grid(f32(v / s), E4M3, Fraction(448)) * s for v in blk]   # torch divides in fp32
    return _blockwise_ref(x, block, qdq)


def fp4_qdq_ref(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    def qdq(blk):
        amax = max(max(abs(v) for v in blk), f32(6.0 * 2.0 ** -126))
        s = pow2_ceil_exact(f32(np.float32(amax) * np.float32(1.0 / 6.0)))
        return [round_grid(f32(v / s), E2M1, Fraction(6)) * s for v in blk]
    return _blockwise_ref(x, block, qdq)


# ---- grid sanity (of the test's own enumeration, so a typo cannot hide a bug) -------------
def test_hand_grids_are_the_known_formats():
    assert len(E4M3) == 127 and E4M3[-1] == (448, 126) and E4M3[1][0] == Fraction(1, 512)
    assert [float(v) for v, _ in E2M1] == [0, .5, 1, 1.5, 2, 3, 4, 6]


# ---- FP8 e4m3 block QDQ -------------------------------------------------------------------
def test_fp8_scale_is_pow2_round_up():
    # amax 3.0: 3/448 = 0.0067 -> 2^-7 = 0.0078125 ; amax 100 -> 0.223 -> 0.25 ; amax 1 -> 2^-8
    x = torch.zeros(3, 64)
    x[0, 5], x[1, 7], x[2, 0] = 3.0, -100.0, 1.0
    s = Q.fp8_block_scales(x, 64)
    assert s.flatten().tolist() == [2.0 ** -7, 0.25, 2.0 ** -8]


def test_fp8_scale_no_pow2_is_amax_times_fp32_reciprocal():
    x = torch.tensor([[3.0, -1.0]])
    assert Q.fp8_block_scales(x, 2, pow2=False).item() == f32(np.float32(3.0) * np.float32(1 / 448))


def test_fp8_amax_floor_all_zero_and_tiny_blocks():
    # floor 1e-4: 1e-4/448 = 2.23e-7, between 2^-23 and 2^-22 -> s = 2^-22
    x = torch.zeros(2, 32)
    x[1] = torch.linspace(-3e-6, 3e-6, 32)
    s = Q.fp8_block_scales(x, 32)
    assert s.flatten().tolist() == [2.0 ** -22, 2.0 ** -22]
    y = Q.fp8_qdq(x, 32)
    assert torch.equal(y[0], torch.zeros(32))
    assert not torch.isnan(y).any()
    assert torch.equal(y.double(), fp8_qdq_ref(x, 32))
    # 3e-6 / 2^-22 = 12.58 -> e4m3 spacing 1 in [8,16) -> 13 -> 13 * 2^-22
    assert y[1, -1].item() == 13 * 2.0 ** -22


@pytest.mark.parametrize("k", [-6, -1, 0, 3, 8])
def test_fp8_power_of_two_boundary(k):
    """amax = 448·2^k: fp32(448·2^k · fp32(1/448)) is exactly 2^k, so s = 2^k and the max
    element maps to code 448 exactly; the next bf16 value above amax moves to the next binade."""
    a = 448.0 * 2.0 ** k
    assert f32(np.float32(a) * np.float32(1 / 448)) == 2.0 ** k        # independent premise
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 3] = a
    x[0, 9] = -a / 3
    assert Q.fp8_block_scales(x, 128).item() == 2.0 ** k
    q, s = Q.fp8_quantize(x, 128)
    assert q.float()[0, 3].item() == 448.0 and s.item() == 2.0 ** k
    up = a + 2.0 ** (k + 1)                # next bf16 above 1.75·2^(8+k) (7 mantissa bits)
    assert torch.tensor(up).bfloat16().item() == up
    x[0, 3] = up
    assert Q.fp8_block_scales(x, 128).item() == 2.0 ** (k + 1)


def test_fp8_rne_on_every_e4m3_midpoint():
    """Every grid point, midpoint, and the fp32 neighbours of each midpoint, at scale 1
    (each 32-block carries 448 so s = 1), against the hand-enumerated grid."""
    vals = [float(v) for v, _ in E4M3]
    probes = list(vals)
    for lo, hi in zip(vals, vals[1:]):
        m = (lo + hi) / 2
        probes += [m, f32(np.nextafter(np.float32(m), np.float32(0))),
                   f32(np.nextafter(np.float32(m), np.float32(1e9)))]
    probes += [-p for p in probes]
    per = 31
    n = -(-len(probes) // per)
    probes += [0.0] * (n * per - len(probes))
    x = torch.tensor(probes, dtype=torch.float32).view(n, per)
    x = torch.cat([torch.full((n, 1), 448.0), x], 1).view(1, -1)
    assert torch.equal(Q.fp8_block_scales(x, 32), torch.ones(1, n))
    y = Q.fp8_qdq(x, 32).view(n, 32)[:, 1:].flatten()
    ref = [round_grid(p, E4M3, Fraction(448)) for p in probes]
    assert y.tolist() == ref
    # spot checks by hand: tie 0.5*(1+1.125)=1.0625 -> 1 (even code); 1.1875 -> 1.25 (even)
    y1 = Q.fp8_qdq(torch.tensor([[448.0, 1.0625, 1.1875, 272.0, 304.0]]), 5)
    assert y1.tolist() == [[448.0, 1.0, 1.25, 256.0, 320.0]]


@pytest.mark.parametrize("block", [64, 128])
def test_fp8_qdq_random_bf16_against_reference(block):
    g = torch.Generator().manual_seed(1)
    mags = torch.tensor([1e-6, 1e-3, 0.3, 7.0, 1e3, 3e4])
    x = torch.randn(3, 4 * block, generator=g) * mags[torch.randint(0, 6, (3, 4, 1), generator=g)].repeat_interleave(block, 1).view(3, -1)
    x = x.bfloat16()
    y = Q.fp8_qdq(x, block)
    assert y.dtype == torch.float32
    assert torch.equal(y.double(), fp8_qdq_ref(x, block))


def test_fp8_beyond_range_is_clamped_not_nan(monkeypatch):
    """x/s can only exceed 448 if the scale is too small (an fp32 check over one whole binade
    shows fp32(a·fp32(1/448))·448 >= a for every normal a, so amax-derived scales never
    overflow); force small scales to exercise the clamp-before-cast step."""
    a = np.arange(2 ** 23, dtype=np.uint32) + np.uint32(0x43800000)       # all fp32 in [256,512)
    a = a.view(np.float32)
    assert not ((a * np.float32(1 / 448)).astype(np.float64) * 448 < a.astype(np.float64)).any()
    x = torch.tensor([[1000.0, -3000.0, 5.0, 1e30], [-1e6, 2.0, 0.0, -0.5]])
    forced = torch.tensor([[1.0], [0.5]])
    monkeypatch.setattr(Q, "fp8_block_scales", lambda x, block, pow2=True: forced)
    y = Q.fp8_qdq(x, 4)
    q, s = Q.fp8_quantize(x, 4)
    assert not torch.isnan(y).any() and not torch.isnan(q.float()).any()
    assert y.tolist() == [[448.0, -448.0, 5.0, 448.0], [-224.0, 2.0, 0.0, -0.5]]
    assert q.float().tolist() == [[448.0, -448.0, 5.0, 448.0], [-448.0, 4.0, 0.0, -1.0]]


def test_fp8_max_element_maps_to_at_most_448():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 16, generator=g) * 10.0 ** torch.randint(-3, 5, (64, 1), generator=g)
    for pow2 in (False, True):
        q, s = Q.fp8_quantize(x, 16, pow2=pow2)
        assert not torch.isnan(q.float()).any()
        assert (q.float().abs().amax(-1) <= 448).all()
    # without pow2 the block max lands exactly on the top code
    assert torch.equal(Q.fp8_quantize(x, 16, pow2=False)[0].float().abs().amax(-1),
                       torch.full((64,), 448.0))


def test_fp8_block_independence():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 256, generator=g)
    y = Q.fp8_qdq(x, 64)
    x2 = x.clone()
    x2[:, 64:128] *= 1000.0                  # only block 1 changes scale
    y2 = Q.fp8_qdq(x2, 64)
    keep = torch.ones(256, dtype=torch.bool)
    keep[64:128] = False
    assert torch.equal(y[:, keep], y2[:, keep])
    assert torch.equal(y2[:, 64:128], Q.fp8_qdq(x2[:, 64:128], 64))


def test_fp8_quantize_codes_and_scales():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 128, generator=g) * 5).bfloat16()
    q, s = Q.fp8_quantize(x, 64)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 3, 128) and s.shape == (2, 3, 2)
    for v, blk in zip(s.flatten().tolist(), x.float().unflatten(-1, (2, 64)).reshape(-1, 64)):
        assert v == fp8_scale_ref(blk.tolist())
    deq = q.float().unflatten(-1, (2, 64)) * s.unsqueeze(-1)
    assert torch.equal(deq.flatten(-2), Q.fp8_qdq(x, 64))


def test_fp8_rejects_ragged_last_dim():
    with pytest.raises(ValueError):
        Q.fp8_qdq(torch.zeros(2, 100), 64)


# ---- FP4 e2m1 -----------------------------------------------------------------------------
def test_fp4_nibble_table_from_bit_layout():
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        v = Q.FP4_VALUES[code]
        assert abs(v.item()) == mag
        assert bool(torch.signbit(v)) == bool(s)          # code 8 is -0.0
    assert torch.signbit(Q.FP4_VALUES[8]) and Q.FP4_VALUES[8].item() == 0.0


def test_fp4_ties_to_even_code():
    # block with amax 6 -> s = 2^ceil(log2(fp32(6·fp32(1/6)))) = 1
    assert f32(np.float32(6) * np.float32(1 / 6)) == 1.0
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]              # codes 0,2,2,4,4,6,6
    row = [6.0] + ties + [-t for t in ties]
    row += [0.0] * (32 - len(row))
    y = Q.fp4_qdq(torch.tensor([row]), 32)[0]
    assert y[1:8].tolist() == want
    assert y[8:15].tolist() == [-w for w in want]
    assert torch.signbit(y[8])                             # -0.25 -> -0
    # just off the ties goes to the nearest value
    off = [0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998, 5.0000005]
    y2 = Q.fp4_qdq(torch.tensor([[6.0] + off + [0.0] * 24]), 32)[0]
    assert y2[1:8].tolist() == [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0]


def test_round_to_e2m1_against_grid():
    a = torch.linspace(-6.5, 6.5, 2601)
    y = Q.round_to_e2m1(a.clamp(-6, 6))
    assert y.tolist() == [round_grid(v, E2M1, Fraction(6)) for v in a.tolist()]


def test_fp4_scale_floor():
    # floor 6·2^-126: fp32(6·2^-126 · fp32(1/6)) rounds to 2^-126 -> s = 2^-126 (E8M0 byte 1)
    x = torch.zeros(3, 32)
    x[1, 0] = 1e-39                                       # subnormal, below the floor
    x[2, :] = 0.75
    s = Q.fp4_block_scales(x, 32)
    assert s[:, 0].tolist() == [2.0 ** -126, 2.0 ** -126, 0.125]
    y = Q.fp4_qdq(x, 32)
    assert torch.equal(y[0], torch.zeros(32)) and not torch.isnan(y).any()
    # 1e-39 / 2^-126 = 0.085 -> 0 ; 0.75/0.125 = 6 -> 6·0.125
    assert y[1, 0].item() == 0.0 and torch.equal(y[2], torch.full((32,), 0.75))
    assert Q.float_to_e8m0(s[:2, 0]).tolist() == [1, 1]


def test_fp4_qdq_random_against_reference():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 128, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 1e4]).view(4, 1)
    x = x.bfloat16()
    assert torch.equal(Q.fp4_qdq(x, 32).double(), fp4_qdq_ref(x, 32))


def test_unpack_fp4_low_nibble_first():
    # byte 0x92: low nibble 2 (1.0) is element 0, high nibble 9 (-0.5) is element 1
    # byte 0x7F: low 15 (-6) then 7 (6); byte 0x80: low 0 (+0) then 8 (-0)
    b = torch.tensor([[0x92, 0x7F], [0x80, 0x5C]], dtype=torch.uint8)
    v = Q.unpack_fp4(b.view(torch.int8))
    assert v.tolist() == [[1.0, -0.5, -6.0, 6.0], [0.0, 0.0, -2.0, 3.0]]
    assert not torch.signbit(v[1, 0]) and torch.signbit(v[1, 1])
    assert torch.equal(Q.unpack_fp4(b), v)                 # uint8 input too


def test_pack_fp4_hand_bytes_and_roundtrip():
    v = torch.tensor([[1.0, -0.5, -6.0, 6.0], [0.0, -0.0, -2.0, 3.0]])
    p = Q.pack_fp4(v)
    assert p.dtype == torch.int8
    assert p.view(torch.uint8).tolist() == [[0x92, 0x7F], [0x80, 0x5C]]
    with pytest.raises(ValueError):
        Q.pack_fp4(torch.tensor([[0.7, 1.0]]))
    allv = Q.FP4_VALUES.view(1, 16)
    back = Q.unpack_fp4(Q.pack_fp4(allv))
    assert torch.equal(back, allv) and torch.equal(torch.signbit(back), torch.signbit(allv))


@pytest.mark.parametrize("e8m0", [False, True])
def test_dequant_fp4_weight_1x32_scales(e8m0):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (3, 64), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    sbytes = torch.tensor([[127, 130], [120, 127], [0, 200]], dtype=torch.uint8)
    scale = sbytes.view(torch.float8_e8m0fnu) if e8m0 else \
        torch.tensor([[2.0 ** (b - 127) for b in r] for r in sbytes.tolist()])
    w = Q.dequant_fp4_weight(packed, scale)
    table = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    for o in range(3):
        for i in range(64):
            want = table[codes[o, i]] * 2.0 ** (sbytes[o, i // 32].item() - 127)
            assert w[o, i].item() == want, (o, i)


def test_quantize_fp4_weight_roundtrip_through_packed_bytes():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2, 64, generator=g)
    q, s = Q.quantize_fp4_weight(w)
    assert s.shape == (2, 2)
    assert torch.equal((q.unflatten(-1, (2, 32)) * s.unsqueeze(-1)).flatten(-2).double(),
                       fp4_qdq_ref(w, 32))
    deq = Q.dequant_fp4_weight(Q.pack_fp4(q), Q.float_to_e8m0(s).view(torch.float8_e8m0fnu))
    assert torch.equal(deq.double(), fp4_qdq_ref(w, 32))


# ---- E8M0 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_e8m0_bytes(dtype):
    bs = [0, 1, 100, 126, 127, 128, 200, 254]
    b = torch.tensor(bs + [255], dtype=torch.uint8)
    if dtype != torch.uint8:
        b = b.view(dtype)
    v = Q.e8m0_to_float(b)
    assert v.dtype == torch.float32
    for bb, got in zip(bs, v.tolist()):
        assert got == math.ldexp(1.0, bb - 127), bb
    assert v[0].item() == 2.0 ** -127 and v[4].item() == 1.0 and v[7].item() == 2.0 ** 127
    assert math.isnan(v[-1].item())


def test_float_to_e8m0_inverse_and_rejects_non_pow2():
    s = torch.tensor([2.0 ** -126, 0.5, 1.0, 2.0 ** 100])
    assert Q.float_to_e8m0(s).tolist() == [1, 126, 127, 227]
    for bad in (3.0, 0.0, -2.0):
        with pytest.raises(ValueError):
            Q.float_to_e8m0(torch.tensor([bad]))


# ---- FP8 weights (128x128 blocks) -----------------------------------------------------------
@pytest.mark.parametrize("e8m0", [False, True])
def test_dequant_fp8_weight_ragged_shape(e8m0):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(130, 200, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sbytes = torch.tensor([[120, 127], [131, 100]], dtype=torch.uint8)
    scale = sbytes.view(torch.float8_e8m0fnu) if e8m0 else \
        torch.tensor([[2.0 ** (b - 127) for b in r] for r in sbytes.tolist()])
    d = Q.dequant_fp8_weight(w, scale)
    assert d.shape == (130, 200)
    wl, sl = w.float().tolist(), sbytes.tolist()
    want = [[wl[o][i] * 2.0 ** (sl[o // 128][i // 128] - 127) for i in range(200)]
            for o in range(130)]
    assert d.tolist() == want


def test_quantize_fp8_weight_block_scales():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(130, 200, generator=g)
    w[0:128, 128:200] *= 50.0
    w[128:, :128] *= 1e-3
    q, s = Q.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    for bo in range(2):
        for bi in range(2):
            blk = w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            assert s[bo, bi].item() == fp8_scale_ref(blk.flatten().tolist())
    d = Q.dequant_fp8_weight(q, s)
    for bo in range(2):
        for bi in range(2):
            blk = w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            sc = s[bo, bi].item()
            want = [round_grid(v / sc, E4M3, Fraction(448)) * sc for v in blk.flatten().tolist()]
            assert d[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128].flatten().tolist() == want
