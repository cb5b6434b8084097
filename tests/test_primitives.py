"""Primitives (docs/research/dsv4-architecture.md §4.4–§4.6, §4.8) against independent derivations: hand values,
pure-Python fp64 formulas written from the spec, closed forms."""
from __future__ import annotations

import math

import pytest
import torch

from reference_model import primitives as P
from reference_model.numerics import Numerics, sinkhorn_split


def bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item()


# ---- Hadamard -----------------------------------------------------------------------------
def test_hadamard_n4_by_hand():
    h = [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    assert torch.equal(P.hadamard_matrix(4, torch.float64),
                       torch.tensor(h, dtype=torch.float64) / 2)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # x @ H/2 = [10, -2, -4, 0] / 2
    assert P.hadamard(x).tolist() == [[5.0, -1.0, -2.0, 0.0]]


def _sylvester(n: int) -> list[list[float]]:
    """Independent recursion H_{2m} = [[H, H], [H, -H]] on Python lists, then / sqrt(n)."""
    h = [[1.0]]
    while len(h) < n:
        h = [r + r for r in h] + [r + [-v for v in r] for r in h]
    return [[v / math.sqrt(n) for v in r] for r in h]


@pytest.mark.parametrize("n", [1, 2, 8, 32, 128])
def test_hadamard_matches_sylvester_and_closed_form(n):
    h = P.hadamard_matrix(n, torch.float64)
    assert torch.allclose(h, torch.tensor(_sylvester(n), dtype=torch.float64), rtol=0, atol=1e-15)
    closed = [[(-1) ** bin(i & j).count("1") / math.sqrt(n) for j in range(n)] for i in range(n)]
    assert torch.allclose(h, torch.tensor(closed, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-13)
    assert torch.equal(h, h.T)


def test_hadamard_apply_and_fp32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g).bfloat16()
    y = P.hadamard(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    ref = x.double() @ torch.tensor(_sylvester(128), dtype=torch.float64)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    # orthonormal: norms preserved
    assert torch.allclose(y.double().norm(dim=-1), x.double().norm(dim=-1), rtol=1e-5)
    with pytest.raises(ValueError):
        P.hadamard(torch.zeros(2, 96))


# ---- RMSNorm ------------------------------------------------------------------------------
def test_rms_norm_weight_multiplied_before_single_cast():
    """x = [1, 5], w = [1, 3], eps 1e-6: y1 = 5/sqrt(13+1e-6) = 1.386750...
    spec (fp32 multiply, one cast): bf16(3·1.38675) = bf16(4.16025) = 4.15625
    HF-style (cast, multiply, cast): bf16(1.38675) = 1.390625; 3·1.390625 = 4.171875 -> 4.1875"""
    x = torch.tensor([[1.0, 5.0]], dtype=torch.bfloat16)
    w = torch.tensor([1.0, 3.0])
    y = Numerics("reference").rms_norm(x, w, 1e-6)
    assert y[0, 1].item() == 4.15625
    r = 1 / math.sqrt((1 + 25) / 2 + 1e-6)
    assert bf16(3 * 5 * r) == 4.15625 and bf16(3 * bf16(5 * r)) == 4.1875
    assert torch.equal(y, y.bfloat16().to(y.dtype))      # compute dtype holding bf16 values
    assert y[0, 0].item() == bf16(r)


def test_rms_norm_random_vs_fp64():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 64, generator=g) * 3).bfloat16()
    w = torch.rand(64, generator=g) * 2
    eps = 1e-6
    xd, wd = x.double().tolist(), w.double().tolist()
    ref = []
    for row in xd:
        r = 1 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        ref.append([wv * v * r for v, wv in zip(row, wd)])
    ref = torch.tensor(ref, dtype=torch.float64)
    # fp32 primitive (no cast) and exact fp64 profile
    assert torch.allclose(P.rms_norm(x, w, eps).double(), ref, rtol=2e-6, atol=0)
    assert torch.allclose(Numerics("exact", torch.float64).rms_norm(x, w, eps), ref,
                          rtol=1e-13, atol=0)
    # reference profile: one bf16 rounding of the fp64 value (at most 1 ulp off at near-ties)
    y = Numerics("reference").rms_norm(x, w, eps).double()
    assert torch.equal(y, y.bfloat16().double())
    rb = ref.bfloat16().double()
    assert ((y - rb).abs() <= rb.abs() * 2 ** -7).all()
    assert (y == rb).double().mean() > 0.98
    # no weight: plain normalisation
    assert torch.allclose(P.rms_norm(x, None, eps, torch.float64),
                          ref / torch.tensor(wd, dtype=torch.float64), rtol=1e-13)


# ---- RoPE ---------------------------------------------------------------------------------
def _yarn_freqs_fp64(dim, base, factor, orig, beta_fast, beta_slow):
    """§4.6 written out in Python floats."""
    f = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if orig <= 0:
        return f, None, None
    cd = lambda r: dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
    low = max(math.floor(cd(beta_fast)), 0)
    high = min(math.ceil(cd(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, fi in enumerate(f):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(fi / factor * ramp + fi * (1 - ramp))
    return out, low, high


@pytest.mark.parametrize("dim,base", [(64, 10000.0), (64, 160000.0), (16, 500.0)])
def test_rope_inv_freq_no_yarn(dim, base):
    ref, _, _ = _yarn_freqs_fp64(dim, base, 1, 0, 32, 1)
    f64 = P.rope_inv_freq(dim, base, dtype=torch.float64)
    assert torch.allclose(f64, torch.tensor(ref, dtype=torch.float64), rtol=1e-14, atol=0)
    f32 = P.rope_inv_freq(dim, base)
    assert f32.dtype == torch.float32
    assert torch.allclose(f32.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-6)
    assert f64[0].item() == 1.0


def test_rope_inv_freq_yarn_flash_compressed_table():
    ref, low, high = _yarn_freqs_fp64(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert (low, high) == (15, 25)                       # docs/research/dsv4-architecture.md §2
    got = P.rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0, dtype=torch.float64)
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-14, atol=0)
    base = [160000.0 ** (-2 * i / 64) for i in range(32)]
    for i in range(32):
        if i <= 15:
            want = base[i]                                # unchanged (ramp 0 at i = low)
        elif i >= 25:
            want = base[i] / 16                           # fully interpolated
        else:
            t = (i - 15) / 10
            want = base[i] * (1 - t) + base[i] / 16 * t   # linear ramp
        assert got[i].item() == pytest.approx(want, rel=1e-14), i
    f32 = P.rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert torch.allclose(f32.double(), got, rtol=2e-6)


@pytest.mark.parametrize("dim,base,factor,orig,bf,bs", [
    (64, 160000.0, 8.0, 32768, 32.0, 1.0),     # cd(32) = 13.60: floor 13 (not round 14)
    (64, 10000.0, 40.0, 4096, 32.0, 1.0),      # DeepSeek-V3 style numbers
    (16, 10000.0, 4.0, 2048, 32.0, 1.0),       # small rope dim (low 2, high 6)
])
def test_rope_inv_freq_yarn_other_configs(dim, base, factor, orig, bf, bs):
    ref, low, high = _yarn_freqs_fp64(dim, base, factor, orig, bf, bs)
    got = P.rope_inv_freq(dim, base, factor, orig, bf, bs, dtype=torch.float64)
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-14, atol=0)
    if orig == 32768:
        assert (low, high) == (13, 23)


def test_rope_table_unit_amplitude_and_angles():
    f = P.rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 1000, 65535])
    t = P.rope_table(pos, f)
    assert t.shape == (5, 32)
    assert torch.allclose(t.abs(), torch.ones(5, 32, dtype=torch.float64), atol=1e-15, rtol=0)
    ang = [[p * fi for fi in f.tolist()] for p in pos.tolist()]
    ref = torch.tensor([[complex(math.cos(a), math.sin(a)) for a in r] for r in ang])
    assert torch.allclose(t, ref.to(t.dtype), atol=1e-12)
    t32 = P.rope_table(pos, f.float())
    assert t32.dtype == torch.complex64
    assert ((t32.abs() - 1).abs() < 1e-6).all()          # no mscale anywhere


def _rope_ref(x, angles, r, inverse=False):
    """Hand 2x2 rotation of adjacent pairs in the last r dims, fp64. x: nested list
    [n][heads][d] ; angles [n][r/2]."""
    out = []
    for t, heads in enumerate(x):
        oh = []
        for v in heads:
            v = list(v)
            d = len(v)
            for i in range(r // 2):
                a = -angles[t][i] if inverse else angles[t][i]
                j = d - r + 2 * i
                x0, x1 = v[j], v[j + 1]
                v[j], v[j + 1] = x0 * math.cos(a) - x1 * math.sin(a), x0 * math.sin(a) + x1 * math.cos(a)
            oh.append(v)
        out.append(oh)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_apply_rope_interleaved_last_dims(dtype):
    g = torch.Generator().manual_seed(2)
    n, h, d, r = 5, 3, 24, 8
    x = torch.randn(n, h, d, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 2, 17, 300])
    f = [10000.0 ** (-2 * i / r) for i in range(r // 2)]
    ang = [[p * fi for fi in f] for p in pos.tolist()]
    fdt = torch.float64 if dtype == torch.float64 else torch.float32
    table = P.rope_table(pos, torch.tensor(f, dtype=fdt))
    y = P.apply_rope(x, table)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[..., : d - r], x[..., : d - r])            # nope dims untouched
    ref = torch.tensor(_rope_ref(x.double().tolist(), ang, r), dtype=torch.float64)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(y.double(), ref, atol=tol, rtol=0)
    # inverse undoes it (rotation computed in fp32/fp64 on the stored dtype)
    if dtype != torch.bfloat16:
        back = P.apply_rope(y, table, inverse=True)
        assert torch.allclose(back.double(), x.double(), atol=1e-6, rtol=0)
        inv_ref = torch.tensor(_rope_ref(x.double().tolist(), ang, r, inverse=True),
                               dtype=torch.float64)
        assert torch.allclose(P.apply_rope(x, table, inverse=True).double(), inv_ref,
                              atol=tol, rtol=0)


def test_apply_rope_without_head_axis_and_by_hand():
    # one pair, angle pi/2 at position 1 with freq pi/2: (a, b) -> (-b, a)
    table = P.rope_table(torch.tensor([0, 1]), torch.tensor([math.pi / 2], dtype=torch.float64))
    x = torch.tensor([[9.0, 1.0, 2.0], [9.0, 1.0, 2.0]], dtype=torch.float64)
    y = P.apply_rope(x, table)
    assert torch.allclose(y, torch.tensor([[9.0, 1.0, 2.0], [9.0, -2.0, 1.0]], dtype=torch.float64),
                          atol=1e-15)


# ---- Sinkhorn split (§4.8) ----------------------------------------------------------------
def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def _sinkhorn_ref(m, scale, base, hc, iters, eps):
    """Pure-Python fp64 transcription of docs/research/dsv4-architecture.md §4.8 for one token."""
    pre = [_sigmoid(m[j] * scale[0] + base[j]) + eps for j in range(hc)]
    post = [2 * _sigmoid(m[hc + j] * scale[1] + base[hc + j]) for j in range(hc)]
    C = [[m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k] for k in range(hc)]
         for j in range(hc)]
    for j in range(hc):                                     # softmax over each row, + eps
        mx = max(C[j])
        e = [math.exp(v - mx) for v in C[j]]
        C[j] = [v / sum(e) + eps for v in e]

    def colnorm(C):
        cs = [sum(C[j][k] for j in range(hc)) for k in range(hc)]
        return [[C[j][k] / (cs[k] + eps) for k in range(hc)] for j in range(hc)]

    def rownorm(C):
        return [[v / (sum(row) + eps) for v in row] for row in C]

    C = colnorm(C)
    for _ in range(iters - 1):
        C = colnorm(rownorm(C))
    return pre, post, C


@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_sinkhorn_split_vs_fp64_spec(eps):
    g = torch.Generator().manual_seed(3)
    hc = 4
    mixes = torch.randn(5, 24, generator=g, dtype=torch.float64) * 2
    scale = torch.tensor([0.7, 1.3, 2.1], dtype=torch.float64)
    base = torch.randn(24, generator=g, dtype=torch.float64)
    pre, post, comb = sinkhorn_split(mixes, scale, base, hc, 20, eps)
    assert pre.shape == (5, 4) and post.shape == (5, 4) and comb.shape == (5, 4, 4)
    for t in range(5):
        rp, rq, rc = _sinkhorn_ref(mixes[t].tolist(), scale.tolist(), base.tolist(), hc, 20, eps)
        assert torch.allclose(pre[t], torch.tensor(rp, dtype=torch.float64), rtol=1e-13, atol=0)
        assert torch.allclose(post[t], torch.tensor(rq, dtype=torch.float64), rtol=1e-13, atol=0)
        assert torch.allclose(comb[t], torch.tensor(rc, dtype=torch.float64), rtol=1e-12, atol=0)
    # the large-eps case is sensitive to eps placement: "+eps after softmax" vs dropping it
    if eps > 0.01:
        _, _, alt = _sinkhorn_ref(mixes[0].tolist(), scale.tolist(), base.tolist(), hc, 20, 0.0)
        assert not torch.allclose(comb[0], torch.tensor(alt, dtype=torch.float64), atol=1e-4)


def test_sinkhorn_split_fp32_doubly_stochastic():
    """Column sums are ~1 after any run (the last step normalises columns); row sums reach
    1e-3 only when 20 iterations have converged, which needs moderate logits (as after the
    mHC rsqrt normalisation). Peaked logits (std >~ 2) leave row sums off by up to ~1e-2 --
    the fp64 spec transcription shows the same, so that case is checked against it."""
    g = torch.Generator().manual_seed(4)
    scale = torch.tensor([1.0, 1.0, 1.5])
    for mult, converged in ((0.3, True), (3.0, False)):
        mixes = torch.randn(2, 7, 24, generator=g) * mult
        base = torch.randn(24, generator=g) * mult
        pre, post, comb = sinkhorn_split(mixes, scale, base, 4, 20, 1e-6)
        assert comb.dtype == torch.float32
        assert torch.allclose(comb.sum(-2), torch.ones(2, 7, 4), atol=1e-5)
        if converged:
            assert torch.allclose(comb.sum(-1), torch.ones(2, 7, 4), atol=1e-3)
        assert ((pre > 1e-6) & (pre <= 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
        flat = mixes.reshape(-1, 24).double()
        for t in range(flat.shape[0]):
            rp, rq, rc = _sinkhorn_ref(flat[t].tolist(), scale.double().tolist(),
                                       base.double().tolist(), 4, 20, 1e-6)
            f64 = torch.float64
            assert torch.allclose(pre.reshape(-1, 4)[t].double(), torch.tensor(rp, dtype=f64), atol=1e-6)
            assert torch.allclose(post.reshape(-1, 4)[t].double(), torch.tensor(rq, dtype=f64), atol=1e-6)
            assert torch.allclose(comb.reshape(-1, 4, 4)[t].double(), torch.tensor(rc, dtype=f64),
                                  atol=1e-5)


def test_sinkhorn_split_hand_values():
    """All-zero mixes and base: pre = 0.5 + eps, post = 1, comb = uniform rows of 1/4 (+eps
    bookkeeping): softmax 1/4 + eps, colsum 1 + 4eps, so every entry stays (1/4+eps)/(1+5eps)·…
    ≈ 1/4 to within 1e-6."""
    pre, post, comb = sinkhorn_split(torch.zeros(1, 24, dtype=torch.float64),
                                     torch.ones(3, dtype=torch.float64),
                                     torch.zeros(24, dtype=torch.float64), 4, 20, 1e-6)
    assert torch.allclose(pre, torch.full((1, 4), 0.5 + 1e-6, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(post, torch.ones(1, 4, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(comb, torch.full((1, 4, 4), 0.25, dtype=torch.float64), atol=1e-6)
