"""The fast paths of the golden kernels (issue 24) give the values of the straightforward
formulation bit for bit (torch.equal, same dtype).

Each `plain_*` below is the one-call formulation the golden used before row blocking,
single storage casts, table lookups and bf16 arithmetic (reference_model at 3d29e61),
written out again here. Inputs come in two kinds: what the model feeds the kernel (bf16 /
fp32 / FP8 / FP4 grid values) and wide-range fp64 values, whose fp64 sums really round, so
a GEMM that summed a row in another order for another number of rows would show. Row
counts are chosen to give several blocks and a remainder (reference_model.numerics
row_blocks), and the GEMM shapes of the tiny and flash presets."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reference_model import numerics as N
from reference_model import primitives as P
from reference_model import quant as Q
from reference_model.numerics import Numerics, row_blocks, sinkhorn_split, topk_lowest_index_ties

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
REF = Numerics("reference")
REF32 = Numerics("reference", F32)
EXACT = Numerics("exact")
EXACT64 = Numerics("exact", F64)
PROFILES = [pytest.param(REF, id="reference"), pytest.param(REF32, id="reference-fp32"),
            pytest.param(EXACT, id="exact"), pytest.param(EXACT64, id="exact64")]
CFG = SimpleNamespace(norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20)
ROWS = [1, 63, 64, 130, 300, 1027]           # one block, edge sizes, several blocks + remainder


@pytest.fixture(autouse=True, params=["default-blocks", "small-blocks"])
def block_size(request, monkeypatch):
    """Every test runs with the shipped block size and with blocks of ROW_BLOCK_MIN rows
    (many blocks and a remainder at these row counts)."""
    if request.param == "small-blocks":
        monkeypatch.setattr(N, "ROW_BLOCK_ELEMS", 1 << 10)
    return request.param


def gen(seed):
    return torch.Generator().manual_seed(seed)


def wide(*shape, seed=0):
    """fp64 values spread over ~2^±40, so fp64 dot products round."""
    g = gen(seed)
    return torch.randn(*shape, generator=g, dtype=F64) * torch.exp2(
        torch.randint(-40, 40, shape, generator=g).to(F64))


def bfv(*shape, seed=0, scale=1.0):
    """bf16 values held in fp64 (what travels between golden kernels)."""
    return (torch.randn(*shape, generator=gen(seed), dtype=F64) * scale).to(BF16).to(F64)


def same(a, b):
    """Bit-for-bit equal, NaN included (torch.equal treats NaN as unequal)."""
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


# ---- the plain formulations (3d29e61) --------------------------------------------------
def plain_rs(nx, x):
    return x.to(nx.cd) if nx.sd == nx.cd else x.float().to(nx.sd).float().to(nx.cd)


def plain_fp8_qdq(x, block, pow2=True):
    xb = x.float().unflatten(-1, (-1, block))
    amax = x.float().unflatten(-1, (-1, block)).abs().amax(-1).clamp_min(Q.FP8_AMAX_FLOOR)
    s = amax * Q._INV_FP8_MAX
    s = (Q.pow2_ceil(s) if pow2 else s).unsqueeze(-1)
    q = (xb / s).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)


def plain_e2m1(v):
    a = v.abs()
    r = torch.zeros_like(a)
    for cond, val in ((a > 0.25, 0.5), (a >= 0.75, 1.0), (a > 1.25, 1.5), (a >= 1.75, 2.0),
                      (a > 2.5, 3.0), (a >= 3.5, 4.0), (a > 5.0, 6.0)):
        r = torch.where(cond, torch.full_like(a, val), r)
    return torch.copysign(r, v)


def plain_fp4_qdq(x, block=32):
    xb = x.float().unflatten(-1, (-1, block))
    s = Q.pow2_ceil(xb.abs().amax(-1).clamp_min(Q.FP4_AMAX_FLOOR) * Q._INV_FP4_MAX).unsqueeze(-1)
    return (plain_e2m1((xb / s).clamp(-Q.FP4_MAX, Q.FP4_MAX)) * s).flatten(-2)


def plain_fp8_linear(nx, x, w):
    if nx.quant:
        x = plain_fp8_qdq(x, 128)
    return plain_rs(nx, nx.c(x) @ nx.c(w).T)


def plain_q_head_rescale(nx, q, eps):
    if not nx.quant:
        return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    r = lambda t: plain_rs(nx, t)                                      # noqa: E731
    ms = r(r(q * q).mean(-1, keepdim=True))
    return r(q * r(torch.rsqrt(r(ms + eps))))


def plain_rope(nx, x, inv, pos, inverse):
    return plain_rs(nx, P.apply_rope(x, P.rope_table(pos, inv), inverse))


def plain_compressor_proj(nx, x, wkv, wgate):
    r32 = lambda t: t.to(nx.cd) if not nx.quant or nx.cd == F32 else t.float().to(nx.cd)  # noqa
    cd = nx.cd
    return r32(x.to(cd) @ wkv.to(cd).T), r32(x.to(cd) @ wgate.to(cd).T)


def plain_index_scores(nx, q, keys, w):
    r = lambda t: plain_rs(nx, t)                                      # noqa: E731
    s = r(torch.einsum("chd,nd->chn", nx.c(q), nx.c(keys)))
    s = r(s.relu() * w.unsqueeze(-1))
    return r(s.sum(1))


def plain_sparse_attention(nx, q, kv, sink, idx, scale):
    valid = idx >= 0
    rows = nx.c(kv)[idx.clamp(min=0)]
    s = torch.einsum("chd,ckd->chk", nx.c(q), rows) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.to(nx.cd).view(1, -1, 1) - m)
    o = torch.einsum("chk,ckd->chd", plain_rs(nx, p), rows) / denom
    return plain_rs(nx, o)


def plain_wo_a(nx, o, w):
    return plain_rs(nx, torch.einsum("cgd,grd->cgr", nx.c(o), nx.c(w)))


def plain_sinkhorn(mixes, scale, base, hc, iters, eps):
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def plain_hc_pre(nx, H, fn, scale, base, cfg):
    n, hc, d = H.shape
    r32 = lambda t: t.to(nx.cd) if not nx.quant or nx.cd == F32 else t.float().to(nx.cd)  # noqa
    X = nx.c(H.reshape(n, hc * d))
    mixes = r32((X @ fn.to(nx.cd).T) * torch.rsqrt(X.square().mean(-1, keepdim=True) + cfg.norm_eps))
    pre, post, comb = (r32(t) for t in plain_sinkhorn(
        mixes, scale.to(nx.cd), base.to(nx.cd), hc, cfg.hc_sinkhorn_iters, cfg.hc_eps))
    return plain_rs(nx, (pre.unsqueeze(-1) * nx.c(H)).sum(1)), post, comb


def plain_hc_post(nx, a, H, post, comb):
    mixed = torch.einsum("njk,njd->nkd", comb.to(nx.cd), nx.c(H))
    return plain_rs(nx, post.to(nx.cd).unsqueeze(-1) * nx.c(a).unsqueeze(1) + mixed)


# ---- casts, tables, rounding rules ----------------------------------------------------------
def _double_rounding_cases(n=200_000, seed=0):
    """fp64 values just past (and just short of, and at) a bf16 midpoint that fp32 rounds
    onto the midpoint: one direct fp64 -> bf16 rounding and the reference's rounding via
    fp32 (ties to even) differ on a quarter of them."""
    b = torch.randn(n, generator=gen(seed), dtype=F64).to(BF16).float()
    mid = (b.view(torch.int32) + 0x8000).view(F32).double()       # the midpoint above |b|
    return torch.cat([mid + mid.abs() * 2.0 ** -30, mid - mid.abs() * 2.0 ** -30, mid])


def _round_fp64_to_bf16_once(x):
    """fp64 -> bf16 value with one round-to-nearest-even on the fp64 bits (normal range)."""
    i = x.view(torch.int64)
    return (((i + (1 << 44) - 1 + ((i >> 45) & 1)) >> 45) << 45).view(F64)


def test_storage_cast_goes_through_fp32():
    """Numerics.rs casts fp64 once (torch's CPU fp64 -> bf16 cast rounds to fp32 first), so
    it must equal the reference's fp32-then-bf16 rounding where one rounding would not."""
    x = _double_rounding_cases()
    via_fp32 = x.float().to(BF16).double()
    assert not same(_round_fp64_to_bf16_once(x), via_fp32)        # the cases do bite
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-42,
                            2.0 ** -133, 2.0 ** -140, 3.3e38, 3.5e38, 1e300, -1e300, 1e-300], dtype=F64)
    x = torch.cat([x, special, wide(100_000, seed=1)])
    assert same(REF.rs(x), plain_rs(REF, x))
    assert same(REF._to_sd(x), x.float().to(BF16))
    assert same(REF32.rs(x.float()), plain_rs(REF32, x.float()))


def test_e4m3_table_is_torchs_cast():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for dt in (F32, F64):
        assert same(Q.e4m3_to_float(codes, dt), codes.to(dt))
    q = torch.randint(0, 256, (37, 129), generator=gen(1), dtype=torch.int32).to(torch.uint8)
    assert same(Q.e4m3_to_float(q.view(torch.float8_e4m3fn)), q.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [F32, F64, BF16, torch.float16])
def test_e2m1_rounding_against_midpoint_rule(dtype):
    """Every value within 64 ulps of each midpoint and grid point, both signs, plus random
    values, ±inf and NaN (every fp32 value was also compared once, outside the suite)."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                        6.0, 7.0], dtype=F64).to(dtype)
    near = [pts]
    up, down = pts.clone(), pts.clone()
    for _ in range(64):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        near += [up, down]
    v = torch.cat(near + [(torch.randn(100_000, generator=gen(2), dtype=F64) * 4).to(dtype),
                          torch.tensor([float("inf"), float("nan"), 1e-30], dtype=F64).to(dtype)])
    v = torch.cat([v, -v])
    assert same(Q.round_to_e2m1(v), plain_e2m1(v))


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_qdq_fast_paths(pow2):
    x = torch.cat([bfv(300, 256, seed=3), wide(64, 256, seed=4), bfv(8, 256, seed=5, scale=1e-6),
                   torch.zeros(2, 256, dtype=F64)])
    x[5, 7], x[6, 200] = float("nan"), float("inf")
    ref = plain_fp8_qdq(x, 128, pow2)
    assert same(Q.fp8_qdq(x, 128, pow2), ref)
    assert same(Q.fp8_qdq(x.float(), 64, pow2), plain_fp8_qdq(x.float(), 64, pow2))
    assert same(Q.fp8_qdq(x, 128, pow2, dtype=F64), ref.double())
    # near the fp32 top the fp32 product overflows where fp64 would not: fp64 output follows fp32
    big = torch.full((1, 128), 3.0e38, dtype=F64)
    assert same(Q.fp8_qdq(big, 128, pow2, dtype=F64), plain_fp8_qdq(big, 128, pow2).double())


def test_fp4_qdq_fast_path():
    x = torch.cat([bfv(200, 128, seed=6), wide(40, 128, seed=7), torch.zeros(1, 128, dtype=F64)])
    assert same(Q.fp4_qdq(x, 32), plain_fp4_qdq(x, 32))
    assert same(Q.fp4_qdq(x.float(), 32), plain_fp4_qdq(x.float(), 32))


def test_bf16_multiply_rounds_the_exact_product_once():
    """index_scores' bf16 fast path: relu(s)·w as a bf16 tensor op equals the fp64 product
    rounded via fp32 to bf16 (including products in the fp32 / bf16 subnormal range)."""
    s = torch.cat([bfv(400_000, seed=8, scale=30),
                   torch.exp2(-torch.randint(60, 75, (1000,), generator=gen(9)).to(F64)).to(BF16).double()])
    w = torch.cat([bfv(400_000, seed=10),
                   torch.exp2(-torch.randint(60, 75, (1000,), generator=gen(11)).to(F64)).to(BF16).double()])
    fast = s.to(BF16).relu_().mul_(w.to(BF16)).double()
    assert same(fast, plain_rs(REF, s.relu() * w))


# ---- blocking -------------------------------------------------------------------------------
def test_row_blocks_cover_rows_with_no_short_block():
    for n in (0, 1, 63, 64, 65, 127, 128, 129, 1000, 2048, 4097):
        for elems in (1, 384, 1024, 6144, 1 << 20):
            bl = row_blocks(n, elems)
            assert bl[0][0] == 0 and bl[-1][1] == n
            assert all(b0 == a1 for (_, b0), (a1, _) in zip(bl, bl[1:]))
            per = N.ROW_BLOCK_ELEMS * torch.get_num_threads()
            step = max(N.ROW_BLOCK_MIN, per // elems // N.ROW_BLOCK_MIN * N.ROW_BLOCK_MIN)
            assert all(b - a == step and a % N.ROW_BLOCK_MIN == 0 for a, b in bl[:-1])
            assert len(bl) == 1 or step <= bl[-1][1] - bl[-1][0] < 2 * step


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_fp8_linear_and_compressor_proj(nx, n):
    for (out, inp) in ((128, 256), (512, 128), (256, 128), (256, 256), (24, 1024)):
        w = bfv(out, inp, seed=out + inp, scale=inp ** -0.5)
        for x in (bfv(n, inp, seed=n), wide(n, inp, seed=n + 1)):
            assert same(nx.fp8_linear(x, w), plain_fp8_linear(nx, x, w)), (out, inp)
    x, wk, wg = bfv(n, 256, seed=12), wide(256, 256, seed=13).float(), bfv(512, 256, seed=14).float()
    assert same(nx.compressor_proj(x, wk, wg), plain_compressor_proj(nx, x, wk, wg))


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_q_head_rescale_rope_wo_a(nx, n):
    q = nx.rs(bfv(n, 4, 128, seed=15, scale=3))
    assert same(nx.q_head_rescale(q, 1e-6), plain_q_head_rescale(nx, q, 1e-6))
    inv = P.rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0, dtype=F64 if nx.cd == F64 else F32)
    pos = torch.arange(1000, 1000 + n)
    for x in (q, nx.rs(bfv(n, 64, seed=16))):
        for inverse in (False, True):
            assert same(nx.rope_apply(x, inv, pos, "q", inverse), plain_rope(nx, x, inv, pos, inverse))
    o, w = bfv(n, 2, 256, seed=17), wide(2, 64, 256, seed=18)
    assert same(nx.wo_a(o, w), plain_wo_a(nx, o, w))


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_mhc(nx, n):
    H = bfv(n, 4, 256, seed=19).to(BF16)
    fn = wide(24, 1024, seed=20).float()
    scale, base = torch.rand(3, generator=gen(21)) + 0.5, torch.randn(24, generator=gen(22))
    got, want = nx.hc_pre(H, fn, scale, base, CFG), plain_hc_pre(nx, H, fn, scale, base, CFG)
    assert same(got, want)
    _, post, comb = want
    a = nx.rs(bfv(n, 256, seed=23))
    assert same(nx.hc_post(a, H, post, comb), plain_hc_post(nx, a, H, post, comb))
    Hw = wide(n, 4, 256, seed=24)
    assert same(nx.hc_post(a, Hw, post, comb), plain_hc_post(nx, a, Hw, post, comb))


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_indexer_scores_and_topk(nx, n):
    h, d, keys_n = 4, 128, 700
    q = Q.fp4_qdq(bfv(n, h, d, seed=25), 32).double() if nx.quant else bfv(n, h, d, seed=25)
    keys = Q.fp4_qdq(bfv(keys_n, d, seed=26), 32).double() if nx.quant else bfv(keys_n, d, seed=26)
    for w in (nx.rs(bfv(n, h, seed=27) * 0.05), wide(n, h, seed=28)):   # bf16 w: fast path
        got = nx.index_scores(q, keys, w)
        assert same(got, plain_index_scores(nx, q, keys, w))
    vis = torch.randint(0, keys_n + 1, (n, 1), generator=gen(29))
    s = got.masked_fill(torch.arange(keys_n) >= vis, float("-inf"))
    s[0, :5] = float("nan")
    for k in (16, 1000):
        assert same(nx.index_topk(s, k), topk_lowest_index_ties(s, k))


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_sparse_attention(nx, n):
    N_rows, k = 900, 48
    q, kv, sink = nx.rs(bfv(n, 4, 128, seed=30)), nx.rs(bfv(N_rows, 128, seed=31)), torch.randn(4, generator=gen(32))
    idx = torch.randint(-1, N_rows, (n, k), generator=gen(33))
    idx[:, 0] = torch.randint(0, N_rows, (n,), generator=gen(34))        # one valid row each
    assert same(nx.sparse_attention(q, kv, sink, idx, 128 ** -0.5),
                plain_sparse_attention(nx, q, kv, sink, idx, 128 ** -0.5))
    qw, kvw = wide(n, 4, 128, seed=35) * 1e-12, wide(N_rows, 128, seed=36) * 1e-12
    assert same(nx.sparse_attention(qw, kvw, sink, idx, 128 ** -0.5),
                plain_sparse_attention(nx, qw, kvw, sink, idx, 128 ** -0.5))


def hca_indices(n, window=32, entries=24, ratio=16):
    """V4's HCA layout: each query's window band of rows, then every compressed entry it
    may see (rows past the window rows), -1 where there is none: rows most queries share."""
    pos = torch.arange(n)
    band = pos.unsqueeze(1) + torch.arange(-(window - 1), 1)
    j = torch.arange(entries).unsqueeze(0)
    comp = torch.where(j < ((pos + 1) // ratio).clamp(max=entries).unsqueeze(1), j + n, -1)
    return torch.cat([torch.where(band >= 0, band, -1), comp], 1)


@pytest.mark.parametrize("nx", PROFILES)
@pytest.mark.parametrize("n", ROWS)
def test_sparse_attention_on_shared_rows(nx, n):
    """The one-GEMM path over rows the queries share (taken in the fp64 reference) against
    the plain gather, on grid values; a non-finite row stays its readers' own."""
    idx = hca_indices(n)
    q, kv = nx.rs(bfv(n, 4, 128, seed=40)), nx.rs(bfv(n + 24, 128, seed=41, scale=3.0))
    sink = torch.randn(4, generator=gen(42))
    assert same(nx.sparse_attention(q, kv, sink, idx, 128 ** -0.5),
                plain_sparse_attention(nx, q, kv, sink, idx, 128 ** -0.5))
    kv[n + 23] = float("inf")                              # read only by the last queries, if any
    assert same(nx.sparse_attention(q, kv, sink, idx, 128 ** -0.5),
                plain_sparse_attention(nx, q, kv, sink, idx, 128 ** -0.5))


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("hc", [2, 3, 4, 5])
def test_sinkhorn_tokens_last(dtype, hc):
    """Sinkhorn with the token axis last sums 2-4 entries left to right, as torch's sum over
    a dimension of 2-4 does (wide-range values, where another order would round otherwise);
    other sizes keep torch's sum."""
    g = gen(hc)
    for n in (2048, 7, 1):
        c = wide(n, hc, hc, seed=hc + n)
        for dim in (-1, -2):
            parts = c.unbind(dim)
            seq = parts[0]
            for p in parts[1:]:
                seq = seq + p
            assert same(c.sum(dim), seq) or hc > 4
        mixes = (torch.randn(3, n, hc * (hc + 2), generator=g, dtype=F64) * 5).to(dtype)
        scale = (torch.rand(3, generator=g, dtype=F64) * 3).to(dtype)
        base = torch.randn(hc * (hc + 2), generator=g, dtype=F64).to(dtype)
        assert same(sinkhorn_split(mixes, scale, base, hc, 20, 1e-6),
                    plain_sinkhorn(mixes, scale, base, hc, 20, 1e-6))


def test_blocked_kernels_with_two_threads():
    """MKL's per-row sums with 2 threads, blocked as with 1 (the bench runs 2 threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (300, 1027):
            test_fp8_linear_and_compressor_proj(REF, n)
            test_mhc(REF, n)
            test_indexer_scores_and_topk(REF, n)
            test_sparse_attention(REF, n)
    finally:
        torch.set_num_threads(old)


# ---- autograd: the fast paths step aside --------------------------------------------------
def test_under_autograd_values_and_gradients_are_the_plain_ones():
    nx = Numerics("reference", F32)                     # the QAT numerics
    x = bfv(300, 256, seed=37).float().requires_grad_()
    w = bfv(128, 256, seed=38, scale=1 / 16).float().requires_grad_()
    got = nx.fp8_linear(x, w)
    want = plain_fp8_linear(nx, x, w)
    assert same(got.detach(), want.detach())
    g1 = torch.autograd.grad(got.sum(), (x, w))
    g2 = torch.autograd.grad(want.sum(), (x, w))
    assert same(g1, g2) and g1[0].abs().sum() > 0               # straight-through reaches x
    q = Q.fp4_qdq(bfv(300, 4, 128, seed=39), 32).requires_grad_()
    keys = Q.fp4_qdq(bfv(400, 128, seed=40), 32).requires_grad_()
    wt = nx.rs(bfv(300, 4, seed=41) * 0.05).requires_grad_()
    got = nx.index_scores(q, keys, wt)
    want = plain_index_scores(nx, q, keys, wt)
    assert same(got.detach(), want.detach())
    assert same(torch.autograd.grad(got.sum(), (q, keys, wt)), torch.autograd.grad(want.sum(), (q, keys, wt)))


@pytest.mark.parametrize("nx", PROFILES)
def test_batched_and_empty_inputs_take_one_call(nx):
    """Training feeds [B, T, d] activations (one call, no row blocks); an empty chunk gives
    an empty result."""
    x, w = bfv(3, 200, 256, seed=42), bfv(128, 256, seed=43, scale=1 / 16)
    assert same(nx.fp8_linear(x, w), plain_fp8_linear(nx, x, w))
    wk, wg = bfv(256, 256, seed=44).float(), bfv(256, 256, seed=45).float()
    assert same(nx.compressor_proj(x, wk, wg), plain_compressor_proj(nx, x, wk, wg))
    e = x[0, :0]
    assert nx.fp8_linear(e, w).shape == (0, 128)
    assert nx.q_head_rescale(nx.rs(bfv(0, 4, 128)), 1e-6).shape == (0, 4, 128)
    assert nx.index_topk(torch.zeros(0, 50, dtype=nx.cd), 16).shape == (0, 16)
