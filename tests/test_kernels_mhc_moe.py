"""Golden mHC and MoE kernels of the seam (reference_model/numerics_mix.py) against
brute-force fp64 transcriptions and hand values written from docs/research/dsv4-architecture.md §4.8, §5.2, §5.6,
§5.7: hc_pre / hc_post / hc_head, router scores and weights, the clamped SwiGLU expert and
the one-cast combine (attention-side kernels: test_kernels.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kernel_util import (ALL, EXACT, F64, REF, REF32, assert_bf16_close, bf, bf16_round,  # noqa: F401
                         gen, is_bf16)

CFG = SimpleNamespace(norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20)


def _all(scores):
    """route_weights index argument picking every column (hand-checked weights)."""
    return torch.arange(scores.shape[-1]).expand(scores.shape[0], -1)


# ---- mHC (§4.8, §5.2, §5.7) ---------------------------------------------------------------
def sinkhorn_ref(m, scale, base, hc, iters, eps):
    """fp64 torch transcription of §4.8 (not the code under test)."""
    pre = 1 / (1 + torch.exp(-(m[:, :hc] * scale[0] + base[:hc]))) + eps
    post = 2 / (1 + torch.exp(-(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])))
    C = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    C = torch.exp(C - C.amax(-1, keepdim=True))
    C = C / C.sum(-1, keepdim=True) + eps
    C = C / (C.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(2, keepdim=True) + eps)
        C = C / (C.sum(1, keepdim=True) + eps)
    return pre, post, C


def mhc_inputs(seed, n=3, hc=4, d=8, rows=24):
    g = gen(seed)
    H = bf(torch.randn(n, hc, d, generator=g, dtype=F64))
    fn = torch.randn(rows, hc * d, generator=g) * 0.2
    scale = torch.rand(3 if rows > hc else 1, generator=g) + 0.5
    base = torch.randn(rows, generator=g) * 0.5
    return H, fn, scale, base


def mixes_ref(H, fn):
    X = H.reshape(H.shape[0], -1).double()
    r = 1 / torch.sqrt((X * X).mean(-1, keepdim=True) + 1e-6)
    return (X @ fn.double().T) * r


@pytest.mark.parametrize("nm", ALL)
def test_hc_pre_vs_fp64(nm):
    H, fn, scale, base = mhc_inputs(10)
    x, post, comb = nm.hc_pre(H, fn, scale, base, CFG)
    pre_r, post_r, comb_r = sinkhorn_ref(mixes_ref(H, fn), scale.double(), base.double(), 4, 20, 1e-6)
    x_r = (pre_r.unsqueeze(-1) * H).sum(1)
    assert x.shape == (3, 8) and post.shape == (3, 4) and comb.shape == (3, 4, 4)
    if nm is EXACT:
        for a, b in ((x, x_r), (post, post_r), (comb, comb_r)):
            assert torch.allclose(a, b, atol=1e-12, rtol=0)
    else:
        assert torch.allclose(post.double(), post_r, atol=1e-6)
        assert torch.allclose(comb.double(), comb_r, atol=1e-6)
        assert is_bf16(x)
        assert ((x.double() - x_r).abs() <= 2 ** -8 * x_r.abs() + 1e-6).all()


def test_hc_post_orientation_by_hand():
    """comb[j, k]: j = source, k = destination. hc = 2, d = 1:
    H_new[0] = 2·100 + 0.5·1 + 0.125·10 = 201.75 ; H_new[1] = 3·100 + 0.25·1 + 1·10 = 310.25;
    bf16: 202, 310 (spacing 1 and 2 there)."""
    H = torch.tensor([[[1.0], [10.0]]], dtype=F64)
    a = torch.tensor([[100.0]], dtype=F64)
    post = torch.tensor([[2.0, 3.0]], dtype=F64)
    comb = torch.tensor([[[0.5, 0.25], [0.125, 1.0]]], dtype=F64)
    assert EXACT.hc_post(a, H, post, comb).tolist() == [[[201.75], [310.25]]]
    for nm in (REF, REF32):
        assert nm.hc_post(a, H, post, comb).double().tolist() == [[[202.0], [310.0]]]


@pytest.mark.parametrize("nm", ALL)
def test_hc_post_vs_fp64(nm):
    H, _, _, _ = mhc_inputs(11)
    g = gen(12)
    a = bf(torch.randn(3, 8, generator=g, dtype=F64))
    post = torch.rand(3, 4, generator=g) * 2
    comb = torch.rand(3, 4, 4, generator=g)
    ref = torch.tensor([[[post[n, k].item() * a[n, d].item()
                          + sum(comb[n, j, k].item() * H[n, j, d].item() for j in range(4))
                          for d in range(8)] for k in range(4)] for n in range(3)], dtype=F64)
    y = nm.hc_post(a, H, post, comb)
    if nm is EXACT:
        assert torch.allclose(y, ref, atol=1e-12)
    else:
        assert_bf16_close(y, ref)


@pytest.mark.parametrize("nm", ALL)
def test_hc_head_vs_fp64(nm):
    H, fn, scale, base = mhc_inputs(13, rows=4)
    pre = 1 / (1 + torch.exp(-(mixes_ref(H, fn) * scale.double() + base.double()))) + 1e-6
    ref = (pre.unsqueeze(-1) * H).sum(1)
    y = nm.hc_head(H, fn, scale, base, CFG)
    assert y.shape == (3, 8)
    if nm is EXACT:
        assert torch.allclose(y, ref, atol=1e-12)
    else:
        assert_bf16_close(y, ref)


# ---- MoE (§5.6) ---------------------------------------------------------------------------
@pytest.mark.parametrize("nm", ALL)
def test_moe_gate_sqrtsoftplus(nm):
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    w = torch.tensor([[0.0, 2.0], [-3.0, 1.0]])
    sc = nm.moe_gate(x, w, "sqrtsoftplus").double()
    # logits [[0, -3], [2, 1]] -> sqrt(log(1 + e^l))
    ref = torch.tensor([[math.sqrt(math.log(1 + math.exp(v))) for v in r] for r in [[0, -3], [2, 1]]],
                       dtype=F64)
    assert torch.allclose(sc, ref, atol=1e-13 if nm is EXACT else 1e-7, rtol=0)
    assert sc[0, 0].item() == pytest.approx(math.sqrt(math.log(2)), abs=1e-7)


@pytest.mark.parametrize("nm", ALL)
def test_route_weights_renormalise_and_scale(nm):
    picked = torch.tensor([[0.1, 0.3], [0.2, 0.2]], dtype=F64)
    assert torch.allclose(nm.route_weights(picked, _all(picked), None, 1.5).double(),
                          torch.tensor([[0.375, 1.125], [0.75, 0.75]], dtype=F64), atol=1e-15)
    assert torch.allclose(nm.route_weights(picked, _all(picked), None, 1.5, renormalize=False).double(),
                          picked * 1.5, atol=1e-7)


def _e4m3_mags():
    out = []
    for code in range(127):                  # 4 exp bits (bias 7), 3 mantissa bits; 127 = NaN
        e, m = code >> 3, code & 7
        out.append((m / 8 * 2.0 ** -6) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3_MAGS = _e4m3_mags()


def q8_single(v: float) -> float:
    """FP8 act-quant of a block whose only nonzero is v: s = 2^ceil(log2(fp32(|v|·fp32(1/448)))),
    e4m3 round-to-nearest-even of v/s, times s."""
    if v == 0:
        return 0.0
    import numpy as np
    a = float(np.float32(abs(v)) * np.float32(1 / 448))
    m, e = math.frexp(a)
    s = 2.0 ** (e - 1 if m == 0.5 else e)
    x = abs(v) / s
    best = min(range(127), key=lambda c: (abs(E4M3_MAGS[c] - x), c % 2))
    return math.copysign(E4M3_MAGS[best] * s, v)


def silu(v):
    return v / (1 + math.exp(-v))


# (gate, up) per token; gate < -10 must NOT be clamped, up is clamped to [-10, 10]
FFN_CASES = [(-12.0, 10.0), (-20.0, -15.0), (15.0, 5.0), (3.0, -11.0), (0.5, 12.0), (-3.0, 2.0)]


@pytest.mark.parametrize("nm", ALL)
def test_expert_ffn_asymmetric_clamp(nm):
    """Token t has x = e_t, so g_t = w1[0, t] and u_t = w3[0, t] exactly; w2 maps the single
    intermediate channel to output 0. Each token row is its own FP8 block, so the reference
    profile's only error is one e4m3 rounding of h (rel <= 2^-4) plus bf16 (2^-8)."""
    D, T, I = 128, len(FFN_CASES), 128
    x = torch.zeros(T, D, dtype=F64)
    x[torch.arange(T), torch.arange(T)] = 1.0
    w1 = torch.zeros(I, D, dtype=F64)
    w3 = torch.zeros(I, D, dtype=F64)
    for t, (gv, uv) in enumerate(FFN_CASES):
        w1[0, t], w3[0, t] = gv, uv
    w2 = torch.zeros(D, I, dtype=F64)
    w2[0, 0] = 1.0
    weight = torch.tensor([0.3, 0.7, 1.3, 0.9, 1.7, 0.45])
    for wt in (weight, None):
        y = nm.expert_ffn(x, w1, w3, w2, wt, 10.0).double()
        assert y.shape == (T, D) and y[:, 1:].abs().sum() == 0
        for t, (gv, uv) in enumerate(FFN_CASES):
            want = silu(min(gv, 10.0)) * max(-10.0, min(uv, 10.0)) * (1.0 if wt is None else weight[t].item())
            clamped_gate = silu(max(-10.0, min(gv, 10.0))) * max(-10.0, min(uv, 10.0)) * (1.0 if wt is None else weight[t].item())
            got = y[t, 0].item()
            tol = 1e-13 if nm is EXACT else 0.07
            assert got == pytest.approx(want, rel=tol), (t, got, want)
            if gv < -10:                       # would be detected if the gate were clamped below
                assert got != pytest.approx(clamped_gate, rel=0.5)
        if nm is not EXACT:                    # the full reference rounding chain, by hand
            for t, (gv, uv) in enumerate(FFN_CASES):
                h = silu(min(gv, 10.0)) * max(-10.0, min(uv, 10.0))
                if wt is not None:
                    h *= weight[t].item()          # fp32 weight, applied BEFORE w2
                assert y[t, 0].item() == bf16_round(q8_single(bf16_round(h))), t
    # limit 0 disables the clamp entirely
    y0 = nm.expert_ffn(x, w1, w3, w2, None, 0.0).double()
    assert y0[2, 0].item() == pytest.approx(silu(15.0) * 5.0, rel=1e-13 if nm is EXACT else 0.07)
    assert y0[4, 0].item() == pytest.approx(silu(0.5) * 12.0, rel=1e-13 if nm is EXACT else 0.07)


@pytest.mark.parametrize("nm", ALL)
def test_moe_combine_one_cast(nm):
    r = torch.tensor([[1.0, 256.0]], dtype=F64)
    s = torch.tensor([[2 ** -9, 1.0]], dtype=F64)
    y = nm.moe_combine(r, s).double()
    if nm is EXACT:
        assert y.tolist() == [[1 + 2 ** -9, 257.0]]
    else:
        assert y.tolist() == [[1.0, 256.0]]      # 1+2^-9 and 257 both round (ties/spacing 2)


