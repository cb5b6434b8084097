"""Golden kernels of the seam (reference_model/numerics.py), attention side: sparse
attention, indexer, q rescale, KV store, GEMMs, compressor pooling, RoPE tables, against
brute-force fp64 loops and hand values written from docs/research/dsv4-architecture.md §4.6-§4.7, §5.4-§5.5, §7 (mHC
and MoE: test_kernels_mhc_moe.py). Each kernel is run in the `reference` profile (bf16
storage; default fp64 and the fp32 compute variant) and in the `exact` fp64 profile: exact
must match fp64 to ~1e-12, reference to bf16 tolerance."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kernel_util import (ALL, EXACT, F64, REF, REF32, assert_bf16_close, bf, bf16_round,  # noqa: F401
                         gen, is_bf16)


# ---- sparse attention (§4.7) --------------------------------------------------------------
def attn_ref(q, kv, sink, idx, scale):
    """Brute force: per query and head, softmax over the valid gathered rows with exp(sink)
    added to the denominator only."""
    q, kv, sink = q.double().tolist(), kv.double().tolist(), sink.double().tolist()
    out = []
    for c, row in enumerate(idx.tolist()):
        rows = [j for j in row if j >= 0]
        oc = []
        for h, qh in enumerate(q[c]):
            s = [scale * sum(a * b for a, b in zip(qh, kv[j])) for j in rows]
            m = max(s)
            e = [math.exp(v - m) for v in s]
            den = sum(e) + math.exp(sink[h] - m)
            oc.append([sum(e[i] * kv[j][d] for i, j in enumerate(rows)) / den
                       for d in range(len(kv[0]))])
        out.append(oc)
    return torch.tensor(out, dtype=F64)


def attn_inputs(seed=0, c=4, H=3, D=16, N=11, k=6):
    g = gen(seed)
    q = bf(torch.randn(c, H, D, generator=g, dtype=F64))
    kv = bf(torch.randn(N, D, generator=g, dtype=F64))
    sink = torch.randn(H, generator=g, dtype=F64).float()
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(c)])
    idx[1, 2] = -1
    idx[2, 0] = idx[2, 5] = -1
    idx[3, :3] = -1
    return q, kv, sink, idx, D ** -0.5


@pytest.mark.parametrize("nm", ALL)
def test_sparse_attention_vs_bruteforce(nm):
    q, kv, sink, idx, scale = attn_inputs()
    o = nm.sparse_attention(q, kv, sink, idx, scale)
    ref = attn_ref(q, kv, sink, idx, scale)
    assert o.shape == ref.shape
    if nm is EXACT:
        assert torch.allclose(o, ref, atol=1e-13, rtol=0)
    else:
        # bf16 probabilities (rel 2^-9) and a bf16 output (rel 2^-9): |err| <= 2^-8 max|kv|
        assert is_bf16(o)
        assert (o.double() - ref).abs().max() <= 2 ** -8 * kv.abs().max()


@pytest.mark.parametrize("nm", ALL)
def test_sparse_attention_index_order_and_padding_irrelevant(nm):
    q, kv, sink, idx, scale = attn_inputs(1)
    o = nm.sparse_attention(q, kv, sink, idx, scale)
    perm = torch.stack([r[torch.randperm(r.numel(), generator=gen(7))] for r in idx])
    padded = torch.cat([torch.full((idx.shape[0], 3), -1), perm], 1)
    for other in (perm, padded):
        o2 = nm.sparse_attention(q, kv, sink, other, scale)
        assert torch.allclose(o2.double(), o.double(), atol=1e-12 if nm is EXACT else 2 ** -8 * kv.abs().max().item(), rtol=0)


def test_sparse_attention_sink_by_hand():
    """Two rows with score 0 and sink 0: o = (kv0 + kv1) / 3 (sink only in the denominator);
    sink -inf gives the plain average; -1 rows contribute nothing."""
    q = torch.zeros(1, 2, 4, dtype=F64)
    kv = torch.tensor([[3.0, 0, 0, 6], [0, 3.0, 6, 0], [99, 99, 99, 99]], dtype=F64)
    idx = torch.tensor([[0, -1, 1]])
    sink = torch.tensor([0.0, float("-inf")])
    for nm in (EXACT, REF, REF32):
        o = nm.sparse_attention(q, kv, sink, idx, 1.0).double()
        assert torch.allclose(o[0, 0], torch.tensor([1.0, 1, 2, 2], dtype=F64), atol=1e-15)
        assert torch.allclose(o[0, 1], torch.tensor([1.5, 1.5, 3, 3], dtype=F64), atol=1e-15)


def test_sparse_attention_probabilities_rounded_to_bf16_before_pv():
    """kv0 = [0, 0], kv1 = [1, 256], q = [bf16(ln .3), 0], scale 1, no sink:
    s = [0, -1.203125], p1 = exp(-1.203125) = 0.300263 -> bf16 0.30078125.
    reference: bf16(0.30078125·256 / 1.300263) = bf16(59.219) = 59.25;
    exact: 0.300263·256 / 1.300263 = 59.117 (the denominator uses the fp32 p)."""
    q = torch.tensor([[[-1.203125, 0.0]]], dtype=F64)
    kv = torch.tensor([[0.0, 0.0], [1.0, 256.0]], dtype=F64)
    idx = torch.tensor([[0, 1]])
    sink = torch.tensor([float("-inf")])
    p1 = math.exp(-1.203125)
    assert bf16_round(p1) == 0.30078125 and bf16_round(0.30078125 * 256 / (1 + p1)) == 59.25
    assert EXACT.sparse_attention(q, kv, sink, idx, 1.0)[0, 0, 1].item() == pytest.approx(
        p1 * 256 / (1 + p1), rel=1e-14)
    for nm in (REF, REF32):
        assert nm.sparse_attention(q, kv, sink, idx, 1.0)[0, 0, 1].item() == 59.25


def test_sparse_attention_reference_close_to_fp64_at_realistic_size():
    g = gen(3)
    c, H, D, N, k = 3, 4, 64, 200, 48
    q = bf(torch.randn(c, H, D, generator=g, dtype=F64) * 2)
    kv = bf(torch.randn(N, D, generator=g, dtype=F64))
    sink = torch.randn(H, generator=g)
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(c)])
    ref = EXACT.sparse_attention(q, kv, sink, idx, D ** -0.5)
    assert torch.allclose(ref, attn_ref(q, kv, sink, idx, D ** -0.5), atol=1e-13)
    for nm in (REF, REF32):
        o = nm.sparse_attention(q, kv, sink, idx, D ** -0.5).double()
        assert (o - ref).abs().max() <= 2 ** -8 * kv.abs().max()


# ---- indexer (§5.5) -----------------------------------------------------------------------
def index_scores_ref(q, keys, w):
    q, keys, w = q.double().tolist(), keys.double().tolist(), w.double().tolist()
    return torch.tensor([[sum(max(sum(a * b for a, b in zip(q[c][h], kT)), 0.0) * w[c][h]
                              for h in range(len(q[c]))) for kT in keys]
                         for c in range(len(q))], dtype=F64)


@pytest.mark.parametrize("nm", ALL)
def test_index_scores_vs_fp64(nm):
    g = gen(4)
    q = bf(torch.randn(3, 5, 16, generator=g, dtype=F64))
    keys = bf(torch.randn(9, 16, generator=g, dtype=F64))
    w = bf(torch.randn(3, 5, generator=g, dtype=F64))
    s = nm.index_scores(q, keys, w)
    ref = index_scores_ref(q, keys, w)
    assert s.shape == (3, 9)
    if nm is EXACT:
        assert torch.allclose(s, ref, atol=1e-12, rtol=0)
    else:
        assert is_bf16(s)
        # three bf16 roundings per term (dot, product, sum): bound by 2^-7 Σ_h |term|
        mag = index_scores_ref(q, keys, w.abs())
        assert ((s.double() - ref).abs() <= 2 ** -7 * mag + 1e-30).all()


def test_index_scores_relu_by_hand():
    # head 0: q·k = 2 (kept, × w 0.5 = 1); head 1: q·k = -3 (relu 0, w irrelevant)
    q = torch.tensor([[[1.0, 1.0], [-1.0, -2.0]]], dtype=F64)
    keys = torch.tensor([[1.0, 1.0]], dtype=F64)
    w = torch.tensor([[0.5, 100.0]], dtype=F64)
    for nm in (EXACT, REF, REF32):
        assert nm.index_scores(q, keys, w).double().tolist() == [[1.0]]


def topk_ref(row, k):
    """Brute force: sort by (score desc, index asc); -inf picks become -1; return multiset."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    return sorted(-1 if row[i] == float("-inf") else i for i in order)


@pytest.mark.parametrize("nm", [pytest.param(EXACT, id="exact64"), pytest.param(REF, id="reference")])
def test_index_topk_ties_and_invisible(nm):
    g = gen(5)
    scores = torch.randint(0, 4, (6, 20), generator=g).double()      # many ties
    scores[0, 10:] = float("-inf")                                   # 10 visible, k = 12
    scores[1, :] = float("-inf")                                     # nothing visible
    scores[2, ::2] = float("-inf")
    for k in (1, 5, 12, 20):
        idx = nm.index_topk(scores, k)
        assert idx.shape == (6, k) and idx.dtype == torch.long
        for r in range(6):
            assert sorted(idx[r].tolist()) == topk_ref(scores[r].tolist(), k), (k, r)
        assert torch.equal(nm.index_topk(scores, k), idx)          # deterministic
    # hand: ties at the cut go to the lowest index
    s = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]])
    assert sorted(nm.index_topk(s, 3)[0].tolist()) == [1, 2, 3]
    assert sorted(nm.index_topk(s, 4)[0].tolist()) == [1, 2, 3, 4]
    s = torch.tensor([[5.0, float("-inf"), float("-inf"), 7.0]])
    assert sorted(nm.index_topk(s, 3)[0].tolist()) == [-1, 0, 3]
    # an all-invisible row gives only -1 (regression: nan_to_num also mapped -inf to finite)
    assert nm.index_topk(torch.full((1, 5), float("-inf"), dtype=F64), 3).tolist() == [[-1, -1, -1]]
    # NaN scores are never picked while a real score is left; otherwise they count as -inf
    s = torch.tensor([[float("nan"), 1.0, 2.0]])
    assert sorted(nm.index_topk(s, 2)[0].tolist()) == [1, 2]
    assert sorted(nm.index_topk(s, 3)[0].tolist()) == [-1, 1, 2]


@pytest.mark.parametrize("nm", ALL)
def test_index_query_hadamard_then_fp4(nm):
    """q = e_0 (d = 128): Hadamard gives 1/sqrt(128) = 0.0883883 everywhere. Reference:
    bf16 -> 0.08837890625; block amax -> s = 2^ceil(log2(0.0884/6)) = 2^-6; 5.656 -> e2m1 6
    -> 6/64 = 0.09375. Exact: 1/sqrt(128)."""
    q = torch.zeros(1, 2, 128, dtype=F64)
    q[0, :, 0] = 1.0
    y = nm.index_query(q).double()
    want = 128 ** -0.5 if nm is EXACT else 0.09375
    assert torch.allclose(y, torch.full((1, 2, 128), want, dtype=F64), atol=1e-15, rtol=0)


# ---- q rescale, kv store, GEMMs -----------------------------------------------------------
def test_q_head_rescale_exact_and_bf16():
    g = gen(6)
    q = bf(torch.randn(3, 4, 32, generator=g, dtype=F64) * 5)
    ref = torch.tensor([[[v / math.sqrt(sum(x * x for x in h) / len(h) + 1e-6) for v in h]
                         for h in c] for c in q.tolist()], dtype=F64)
    assert torch.allclose(EXACT.q_head_rescale(q, 1e-6), ref, rtol=1e-13, atol=0)
    # reference: the bf16 tensor expression of the reference code, each op rounded to bf16.
    # rsqrt is taken in fp32 then rounded (GPU semantics): torch-CPU's bf16 rsqrt rounds
    # sqrt to bf16 first and is 1 ulp off in ~half of the cases (e.g. rsqrt(21.25) gives
    # 0.21582 instead of the correctly rounded 0.21680), so it is not a usable oracle.
    qb = q.to(torch.bfloat16)
    ms = qb.square().mean(-1, keepdim=True) + 1e-6
    lit = (qb * torch.rsqrt(ms.float()).bfloat16()).double()
    for nm in (REF, REF32):
        y = nm.q_head_rescale(q, 1e-6).double()
        assert is_bf16(y)
        assert torch.equal(y, lit)
        assert ((y - lit).abs() <= 2 ** -7 * lit.abs()).all()
        assert ((y - ref).abs() <= 2 ** -6 * ref.abs()).all()


@pytest.mark.parametrize("nm", ALL)
def test_kv_store_fp8_on_nope_blocks_of_64(nm):
    """Block 0 carries 448 (s = 1): 1.0625 is an e4m3 tie -> 1.0 ; block 1 carries 448/2^4
    (s = 2^-4): 0.066 -> /s = 1.0625+ ... chosen on-grid so it survives."""
    x = torch.zeros(1, 128, dtype=F64)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0625, 1.1875
    x[0, 64], x[0, 65] = 28.0, 0.0625
    y = nm.kv_store(x).double()
    if nm is EXACT:
        assert torch.equal(y, x)
    else:
        assert y[0, :3].tolist() == [448.0, 1.0, 1.25]              # RNE ties to even code
        assert y[0, 64:66].tolist() == [28.0, 0.0625]
        assert y[0, 3:64].abs().sum() == 0


@pytest.mark.parametrize("nm", ALL)
def test_fp8_linear_act_quant_before_gemm(nm):
    """W picks single input columns, so the output shows Q8(x) directly: with the block max
    448 (s = 1) the input 1.0625 becomes 1.0 in the reference; integers in [-4, 4] with
    block max 4 are exact under s = 2^-6."""
    x = torch.zeros(2, 256, dtype=F64)
    x[0, 0], x[0, 1], x[0, 130] = 448.0, 1.0625, 3.0
    x[1, 128:] = torch.arange(128, dtype=F64) % 9 - 4
    w = torch.zeros(3, 256, dtype=F64)
    w[0, 1] = 1.0
    w[1, 130] = 2.0
    w[2, 128:] = 1.0 / 64
    y = nm.fp8_linear(x, w).double()
    first = 1.0625 if nm is EXACT else 1.0
    assert y[0].tolist() == [first, 6.0, 3.0 / 64]
    assert y[1].tolist() == [0.0, 2 * x[1, 130].item(), bf(torch.tensor(x[1, 128:].sum().item() / 64)).item()]


@pytest.mark.parametrize("nm", ALL)
def test_bf16_linear_and_wo_a_vs_fp64(nm):
    g = gen(8)
    x = bf(torch.randn(3, 40, generator=g, dtype=F64))
    w = bf(torch.randn(5, 40, generator=g, dtype=F64))
    ref = torch.tensor([[sum(a * b for a, b in zip(xr, wr)) for wr in w.tolist()] for xr in x.tolist()])
    y = nm.bf16_linear(x, w).double()
    o = bf(torch.randn(3, 2, 16, generator=g, dtype=F64))
    wa = bf(torch.randn(2, 4, 16, generator=g, dtype=F64))
    refa = torch.tensor([[[sum(a * b for a, b in zip(o[c, gi].tolist(), wa[gi, r].tolist()))
                           for r in range(4)] for gi in range(2)] for c in range(3)], dtype=F64)
    ya = nm.wo_a(o, wa).double()
    if nm is EXACT:
        assert torch.allclose(y, ref.double(), atol=1e-12) and torch.allclose(ya, refa, atol=1e-12)
    else:
        assert_bf16_close(y, ref)
        assert_bf16_close(ya, refa)


@pytest.mark.parametrize("nm", ALL)
def test_lm_head_fp32_logits(nm):
    g = gen(9)
    x = bf(torch.randn(2, 32, generator=g, dtype=F64))
    w = torch.randn(7, 32, generator=g)
    ref = x @ w.double().T
    y = nm.lm_head(x, w)
    if nm is EXACT:
        assert torch.allclose(y, ref, atol=1e-12)
    else:
        assert y.dtype == torch.float32                         # logits in fp32
        assert torch.allclose(y.double(), ref, atol=1e-5)


# ---- compressor pooling (§5.4) ------------------------------------------------------------
@pytest.mark.parametrize("nm", ALL)
def test_compress_pool_softmax_per_channel_over_tokens(nm):
    g = gen(14)
    kv = torch.randn(2, 5, 6, generator=g, dtype=F64)
    score = torch.randn(2, 5, 6, generator=g, dtype=F64) * 2
    score[0, :2, :] = float("-inf")                  # absent "previous" half: weight 0
    kv[0, :2, :] = 0.0
    y = nm.compress_pool(kv, score).double()
    ref = torch.empty(2, 6, dtype=F64)
    for gi in range(2):
        for c in range(6):
            s = [score[gi, t, c].item() for t in range(5)]
            m = max(s)
            e = [math.exp(v - m) for v in s]
            ref[gi, c] = sum(e[t] * kv[gi, t, c].item() for t in range(5)) / sum(e)
    assert torch.allclose(y, ref, atol=1e-13 if nm is EXACT else 1e-6, rtol=0)
    # hand: equal scores -> plain average per channel
    kv2 = torch.tensor([[[1.0, 10.0], [3.0, 30.0]]], dtype=F64)
    assert torch.allclose(nm.compress_pool(kv2, torch.zeros_like(kv2)).double(),
                          torch.tensor([[2.0, 20.0]], dtype=F64), atol=1e-6)


# ---- RoPE tables per layer type (§4.6) ----------------------------------------------------
@pytest.mark.parametrize("nm", ALL)
def test_rope_inv_freq_per_layer_type(nm):
    cfg = SimpleNamespace(rope_head_dim=64, rope_theta=10000.0, compress_rope_theta=160000.0,
                          rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)
    win = nm.rope_inv_freq(cfg, 0).double()
    assert torch.allclose(win, torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)],
                                            dtype=F64), rtol=1e-6)
    comp = nm.rope_inv_freq(cfg, 4).double()
    base = [160000.0 ** (-2 * i / 64) for i in range(32)]
    want = [b if i <= 15 else b / 16 if i >= 25 else b * (1 - (i - 15) / 10) + b / 16 * (i - 15) / 10
            for i, b in enumerate(base)]
    assert torch.allclose(comp, torch.tensor(want, dtype=F64), rtol=1e-6)
    assert torch.equal(nm.rope_inv_freq(cfg, 128), nm.rope_inv_freq(cfg, 4))
