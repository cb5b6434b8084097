"""V4.1 kernels (reference_model/v41/kernels.py) against hand computations and independent
formulations written here from docs/v41-architecture.md (§4, §5): ratio-2 / ratio-1
compressors, indexer keys/queries, candidate blocks, lagged mHC, and the window-KV FP8 /
compressed-KV FP4 fake quantisation (Engram: test_v41_kernels_engram.py)."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_util import EXACT, REF, gen as _g, is_bf16 as _is_bf16
from reference_model.numerics import sinkhorn_split
from reference_model.v41 import kernels as K
from reference_model.v41.config import tiny_v41

# ---- GEMM activation quantisation (1x32) ----------------------------------------------------
def test_fp8_linear32_quantises_activations_in_32_blocks():
    """A row whose first 32 channels are large and the rest small: with 1x32 blocks the
    small block keeps its own scale (with 1x128, V4's, it would be flushed)."""
    x = torch.cat([torch.full((1, 32), 300.0), torch.full((1, 96), 0.011)], 1).double()
    w = torch.eye(128, dtype=torch.float64)
    y = K.fp8_linear32(REF, x, w)
    # independent: block scale 2^ceil(log2(amax/448)); e4m3 rounding of x/s via torch's cast
    s_small = 2.0 ** math.ceil(math.log2(0.011 / 448))
    small = torch.tensor(0.011 / s_small).to(torch.float8_e4m3fn).double().item() * s_small
    assert y[0, 40].item() == torch.tensor(small).to(torch.bfloat16).item()
    assert y[0, 0].item() == 288.0 and abs(small - 0.011) / 0.011 < 1 / 16     # e4m3(300) = 288


# ---- compressors ----------------------------------------------------------------------------
def test_ratio2_pool_by_hand():
    """Channel 0: G equal -> weights 1/2, 1/2 -> c = (1+3)/2 = 2; channel 1: G = (ln 3, 0) ->
    weights 3/4, 1/4 -> c = 2·3/4 + 4·1/4 = 2.5."""
    Kv = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    G = torch.tensor([[0.0, math.log(3)], [0.0, 0.0]], dtype=torch.float64)
    pooled, rest = K.compressor_pool2(EXACT, Kv, G)
    assert rest is None and torch.allclose(pooled, torch.tensor([[2.0, 2.5]], dtype=torch.float64), atol=1e-15)
    lat = K.compressor_norm(EXACT, torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.ones(2), 1e-20)
    assert torch.allclose(lat, torch.tensor([[3.0, 4.0]], dtype=torch.float64) / math.sqrt(12.5), atol=1e-15)


def test_ratio2_groups_are_disjoint_and_chunking_is_invisible():
    """Group j pools exactly tokens 2j, 2j+1 (no overlap); pooling 7 tokens in pieces of
    3, 1, 3 with the open group carried equals one call, bit for bit."""
    g = _g(4)
    x = REF.rs(torch.randn(7, 64, generator=g, dtype=torch.float64))
    wkv, wgate = torch.randn(32, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    Kv, G = K.compressor_proj2(REF, x, wkv, wgate)
    one, rest = K.compressor_pool2(REF, Kv, G)
    assert one.shape == (3, 32) and rest[0].shape == (1, 32)
    for j in range(3):
        w = torch.softmax(G[2 * j: 2 * j + 2], 0)
        assert torch.equal(one[j], REF.r32((w * Kv[2 * j: 2 * j + 2]).sum(0)))
    pend, parts = None, []
    for a, b in ((0, 3), (3, 4), (4, 7)):
        p, pend = K.compressor_pool2(REF, Kv[a:b], G[a:b], pend)
        parts.append(p)
    assert torch.equal(torch.cat(parts), one) and torch.equal(pend[0], rest[0])


def test_ratio1_is_a_per_token_projection_then_norm():
    g = _g(9)
    x = REF.rs(torch.randn(5, 64, generator=g, dtype=torch.float64))
    w = torch.randn(32, 64, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(32, generator=g)).bfloat16()
    lat = K.compressor_norm(REF, K.compressor_proj1(REF, x, w), nw, 1e-20)
    y = (x @ w.double().T).float().to(torch.bfloat16).double()       # bf16 GEMM output
    want = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-20) * nw.double()).to(torch.bfloat16).double()
    assert torch.equal(lat, want)
    # per token: the latent of token 3 alone is the same
    assert torch.equal(K.compressor_norm(REF, K.compressor_proj1(REF, x[3:4], w), nw, 1e-20), lat[3:4])


# ---- KV fake quantisation -------------------------------------------------------------------
def _e4m3_grid():
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue                                  # NaN code
            vals.add(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return sorted(vals)


_E4M3 = _e4m3_grid()
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_even(v, grid):
    """Nearest grid value; on a tie the one with an even index (mantissa bit 0)."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - v), i % 2))
    return grid[best]


def _py_fp4_e4m3(block):
    amax = max(max(abs(v) for v in block), 6 * 2 ** -9)
    s = _nearest_even(min(max(amax / 6, 2 ** -9), 448), _E4M3)
    return [math.copysign(_nearest_even(min(abs(v) / s, 6), _E2M1), v) * s for v in block]


def test_fp4_e4m3_by_hand():
    """amax 6: scale 1, 0.3 -> 0.5, ties 1.25 -> 1, 2.5 -> 2, 5 -> 4 (even codes).
    amax 7: scale e4m3(7/6) = 1.125 (not a power of two), 7/1.125 clamps to 6 -> 6.75."""
    a = torch.tensor([[6.0, 0.3, 1.25, 2.5, 5.0, -1.75] + [0.0] * 10])
    assert K.fp4_e4m3_qdq(a)[0, :6].tolist() == [6.0, 0.5, 1.0, 2.0, 4.0, -2.0]
    b = torch.tensor([[7.0, 1.0] + [0.0] * 14])
    assert K.fp4_e4m3_qdq(b)[0, :2].tolist() == [6.75, 1.125]
    assert K.fp4_e4m3_qdq(torch.zeros(1, 16)).eq(0).all()


def test_fp4_e4m3_matches_an_independent_implementation():
    x = torch.randn(6, 64, generator=_g(11)) * torch.tensor([1e-4, 1e-2, 1, 10, 100, 3000]).unsqueeze(1)
    got = K.fp4_e4m3_qdq(x)
    for r in range(6):
        for b in range(4):
            blk = x[r, 16 * b: 16 * b + 16].tolist()
            assert got[r, 16 * b: 16 * b + 16].tolist() == pytest.approx(_py_fp4_e4m3(blk), rel=1e-6, abs=0), (r, b)


def test_compressed_kv_store_is_fp4_in_16_blocks_over_all_dims():
    x = REF.rs(torch.randn(3, 128, generator=_g(12), dtype=torch.float64))
    y = K.compressed_kv_store(REF, x)
    assert _is_bf16(y) and torch.equal(y, REF.rs(K.fp4_e4m3_qdq(x.float(), 16).double()))
    assert not torch.equal(y[:, -64:], x[:, -64:])          # the RoPE tail is quantised too
    assert torch.equal(K.compressed_kv_store(EXACT, x), x)


def test_compressed_entries_rotate_at_the_groups_first_token():
    c = tiny_v41()
    lat = torch.randn(3, 128, generator=_g(21), dtype=torch.float64)
    inv = EXACT.rope_inv_freq(c, 2)
    e = K.compressed_entries(EXACT, lat, inv, torch.tensor([0, 1, 5]), 2)
    for j, g in enumerate([0, 1, 5]):
        assert torch.allclose(e[j], _rope_pairs(lat[j], 2 * g, inv), atol=1e-12)
    r = K.compressed_entries(REF, REF.rs(lat), REF.rope_inv_freq(c, 2), torch.tensor([0, 1, 5]), 2)
    assert torch.equal(r, K.compressed_kv_store(REF, K.rope(REF, REF.rs(lat), REF.rope_inv_freq(c, 2),
                                                                torch.tensor([0, 2, 10]))))


def _py_fp8_block(block):
    amax = max(max(abs(v) for v in block), 1e-4)
    s = 2.0 ** math.ceil(math.log2(amax / 448))
    return [math.copysign(_nearest_even(min(abs(v) / s, 448), _E4M3), v) * s for v in block]


def test_window_kv_store_is_fp8_in_32_blocks_over_all_dims():
    x = torch.randn(2, 128, generator=_g(13), dtype=torch.float64) * 3
    x[0, :32] *= 200                                         # one block with a large amax
    x = REF.rs(x)
    y = K.window_kv_store(REF, x)
    for r in range(2):
        for b in range(4):
            blk = x[r, 32 * b: 32 * b + 32].tolist()
            assert y[r, 32 * b: 32 * b + 32].tolist() == pytest.approx(_py_fp8_block(blk), rel=1e-12, abs=0)
    assert not torch.equal(y[:, -64:], x[:, -64:])
    # hand: amax 448 -> scale 1 (2^-9, the smallest e4m3 subnormal, stays); amax 452 ->
    # scale 2: 452/2 = 226 -> e4m3 224 -> 448, and 2^-9/2 ties to 0 (even code)
    blk = torch.zeros(1, 32, dtype=torch.float64)
    blk[0, 0], blk[0, 1] = 448, 2.0 ** -9
    assert K.window_kv_store(REF, blk)[0, :2].tolist() == [448.0, 2.0 ** -9]
    blk[0, 0] = 452
    assert K.window_kv_store(REF, blk)[0, :2].tolist() == [448.0, 0.0]


# ---- indexer --------------------------------------------------------------------------------
def _rope_pairs(x, pos, inv_freq):
    """Interleaved pairs (2i, 2i+1) of the last 2·len(inv_freq) dims rotated by pos·f_i."""
    x = x.clone()
    r = 2 * len(inv_freq)
    base = x.shape[-1] - r
    for i, f in enumerate(inv_freq.tolist()):
        a, b = x[..., base + 2 * i].clone(), x[..., base + 2 * i + 1].clone()
        ang = pos * f
        x[..., base + 2 * i] = a * math.cos(ang) - b * math.sin(ang)
        x[..., base + 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
    return x


def test_index_keys_exact_profile_by_formula():
    """k = RoPE@(j·r)(k_norm(wk(latent))): no Hadamard, no quantisation in `exact`."""
    c = tiny_v41()
    g = _g(14)
    lat = torch.randn(3, 128, generator=g, dtype=torch.float64)
    wk = torch.randn(128, 128, generator=g, dtype=torch.float64) / 11
    nw = 1 + 0.1 * torch.randn(128, generator=g, dtype=torch.float64)
    inv = EXACT.rope_inv_freq(c, 2)
    pos = torch.tensor([0, 2, 4])                            # group j of ratio 2 at 2j
    k = K.index_keys(EXACT, lat, wk, nw, 1e-20, inv, pos)
    y = lat @ wk.T
    y = y / torch.sqrt(y.square().mean(-1, keepdim=True) + 1e-20) * nw
    for t in range(3):
        assert torch.allclose(k[t], _rope_pairs(y[t], int(pos[t]), inv), atol=1e-12)


def _on_fp4_grid(x, block=32):
    """Every block = e2m1 values times one power of two."""
    for blk in x.reshape(-1, block):
        a = blk.abs()
        if not bool((a > 0).any()):
            continue
        s = 2.0 ** math.ceil(math.log2(float(a.max()) / 6))
        if not all(v / s in _E2M1 for v in a.tolist()):
            return False
    return True


def test_index_keys_and_query_reference_profile_fp4():
    c = tiny_v41()
    g = _g(15)
    lat = REF.rs(torch.randn(4, 128, generator=g, dtype=torch.float64))
    wk = torch.randn(128, 128, generator=g).bfloat16()
    inv = REF.rope_inv_freq(c, 1)
    k = K.index_keys(REF, lat, wk, torch.ones(128), 1e-20, inv, torch.arange(4))
    assert _on_fp4_grid(k) and _is_bf16(k)
    qr = REF.rs(torch.randn(4, 128, generator=g, dtype=torch.float64))
    wq = torch.randn(4 * 128, 128, generator=g) / 11
    q = K.index_query(REF, qr, wq, inv, torch.arange(4), 4)
    assert q.shape == (4, 4, 128) and _on_fp4_grid(q)
    w = K.index_weights(REF, qr, torch.ones(4, 128), 4, 128)
    assert torch.equal(w, REF.rs(REF.rs(qr.sum(-1, keepdim=True).expand(4, 4)) / (math.sqrt(128) * 2)))


def test_visibility_mask_by_hand():
    s = torch.zeros(4, 3, dtype=torch.float64)
    m2 = K.index_visible_mask(s, torch.arange(4), 2)        # visible (t+1)//2 = 0, 1, 1, 2
    assert torch.isinf(m2).tolist() == [[True] * 3, [False, True, True], [False, True, True], [False, False, True]]
    m1 = K.index_visible_mask(s[:2], torch.tensor([0, 2]), 1)   # ratio 1: own latent visible
    assert torch.isinf(m1).tolist() == [[False, True, True], [False, False, False]]


def test_candidate_blocks_by_hand():
    """10 positions, blocks of 4 (padded to 12). Query t=9 (ratio 1, all visible): block
    scores [5, 1, -1] and the newest block (2) forced -> keep blocks 0 and 2. Query t=3:
    only block 0 visible -> it alone."""
    sc = torch.tensor([[0, 5, 0, 0, 1, 1, 1, 1, -1, -1]], dtype=torch.float64).repeat(2, 1)
    pos = torch.tensor([9, 3])
    sc = K.index_visible_mask(sc, pos, 1)
    C = K.candidate_blocks(sc, pos, 1, block=4, topk_blocks=2)
    assert C[0].tolist() == [True] * 4 + [False] * 4 + [True] * 2
    assert C[1].tolist() == [True] * 4 + [False] * 6
    # top-3 inside the candidates vs unrestricted (ties to the lower position)
    assert K.index_topk(sc[:1], 3, C[:1]).tolist() == [[0, 1, 2]]
    assert K.index_topk(sc[:1], 3).tolist() == [[1, 4, 5]]
    # doc §9 D9: fewer candidates than k -> the missing picks are -1 (dropped)
    assert K.index_topk(sc[1:], 6, C[1:]).tolist() == [[0, 1, 2, 3, -1, -1]]
    # before any compressed entry exists: empty mask, no picks
    empty = torch.zeros(2, 0, dtype=torch.float64)
    assert K.candidate_blocks(empty, pos, 1, 4, 2).shape == (2, 0)
    assert K.index_topk(empty, 3).shape == (2, 0)


def _py_candidates(row, t, ratio, B, kb):
    n = len(row)
    nb = -(-n // B)
    bs = [max(row[b * B: b * B + B] + [-math.inf] * (B - len(row[b * B: b * B + B]))) for b in range(nb)]
    newest = (t + 1) // ratio - 1
    if newest >= 0:
        bs[newest // B] = math.inf
    order = sorted(range(nb), key=lambda b: (-bs[b], b))[: min(kb, nb)]
    keep = {b for b in order if bs[b] > -math.inf}
    return [j // B in keep for j in range(n)]


def test_candidate_blocks_match_an_independent_implementation():
    g = _g(16)
    for ratio, n in ((1, 37), (2, 20)):
        pos = torch.arange(0, ratio * n, 3)
        sc = K.index_visible_mask(torch.randn(len(pos), n, generator=g, dtype=torch.float64).round(decimals=1), pos, ratio)
        C = K.candidate_blocks(sc, pos, ratio, block=4, topk_blocks=3)
        for r, t in enumerate(pos.tolist()):
            assert C[r].tolist() == _py_candidates(sc[r].tolist(), t, ratio, 4, 3), (ratio, t)


# ---- lagged mHC ---------------------------------------------------------------------------
def _mhc_weights(hc=4, d=8, seed=17):
    g = _g(seed)
    mix = (2 + hc) * hc
    w = {}
    for site in ("attn", "ffn"):
        w[f"hc_{site}_fn"] = torch.randn(mix, hc * d, generator=g, dtype=torch.float64) * 0.2
        w[f"hc_{site}_base"] = 0.5 * torch.randn(mix, generator=g, dtype=torch.float64)
        w[f"hc_{site}_scale"] = 0.5 + torch.rand(3, generator=g, dtype=torch.float64)
    w["attn_norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    w["ffn_norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    return w


def _py_block(H, P, w, cfg, attn, ffn, own_pre=False):
    """Doc §5.3 written out: mix -> (pre, post, comb); collapse with the previous pre;
    expand; FFN collapses with the attention's pre; P_next = the FFN's pre."""
    def mix(H, site):
        n = H.shape[0]
        X = H.reshape(n, -1)
        m = (X @ w[f"hc_{site}_fn"].T) / torch.sqrt(X.square().mean(-1, keepdim=True) + cfg.norm_eps)
        return sinkhorn_split(m, w[f"hc_{site}_scale"], w[f"hc_{site}_base"], H.shape[1],
                              cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def norm(x, wt):
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + cfg.norm_eps) * wt

    def collapse(H, p):
        return (p.unsqueeze(-1) * H).sum(1)

    def expand(y, H, post, comb):
        return post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("njk,njd->nkd", comb, H)

    pre_a, post_a, comb_a = mix(H, "attn")
    H1 = expand(attn(norm(collapse(H, pre_a if own_pre else P), w["attn_norm.weight"])), H, post_a, comb_a)
    pre_f, post_f, comb_f = mix(H1, "ffn")
    H2 = expand(ffn(norm(collapse(H1, pre_f if own_pre else pre_a), w["ffn_norm.weight"])), H1, post_f, comb_f)
    return H2, pre_f


def test_lagged_block_matches_the_doc_equations_and_the_lag_matters():
    cfg = tiny_v41()
    n, hc, d = 5, 4, 8
    g = _g(18)
    A = torch.randn(d, d, generator=g, dtype=torch.float64) / 3
    Fm = torch.randn(d, d, generator=g, dtype=torch.float64) / 3
    attn, ffn = (lambda x: torch.tanh(x @ A.T)), (lambda x: torch.tanh(x @ Fm.T))
    w = _mhc_weights(hc, d)
    H = torch.randn(n, hc, d, generator=g, dtype=torch.float64)
    P = K.identity_pre_mix(n, hc, torch.float64)
    H1, P1 = K.lagged_block(EXACT, H, P, w, cfg, attn, ffn)
    want_H, want_P = _py_block(H, P, w, cfg, attn, ffn)
    assert torch.allclose(H1, want_H, atol=1e-12) and torch.allclose(P1, want_P, atol=1e-14)
    H2, P2 = K.lagged_block(EXACT, H1, P1, w, cfg, attn, ffn)          # P flows to the next block
    want_H2, _ = _py_block(want_H, want_P, w, cfg, attn, ffn)
    assert torch.allclose(H2, want_H2, atol=1e-12)
    v4_order, _ = _py_block(H, P, w, cfg, attn, ffn, own_pre=True)     # doc §9 D13
    assert (v4_order - H1).abs().max() > 1e-3
    # the identity pre-mix collapses onto stream 0; the head collapses with P_last
    assert torch.equal(K.hc_collapse(EXACT, H, P), H[:, 0])
    x = K.head_collapse(EXACT, H2, P2, torch.ones(d, dtype=torch.float64), cfg.norm_eps)
    y = (P2.unsqueeze(-1) * H2).sum(1)
    assert torch.allclose(x, y / torch.sqrt(y.square().mean(-1, keepdim=True) + 1e-20), atol=1e-12)


def test_lagged_block_reference_profile_rounds_to_bf16_and_engram_runs_first():
    cfg = tiny_v41()
    n, hc, d = 3, 4, 8
    w = _mhc_weights(hc, d, seed=19)
    H = REF.rs(torch.randn(n, hc, d, generator=_g(20), dtype=torch.float64))
    P = K.identity_pre_mix(n, hc, torch.float64)
    seen = []

    def eng(Hx):
        seen.append("engram")
        return REF.rs(Hx * 1.5)

    def attn(x):
        seen.append("attn")
        return x
    H1, P1 = K.lagged_block(REF, H, P, w, cfg, attn, lambda x: x, engram_fn=eng)
    assert seen == ["engram", "attn"] and _is_bf16(H1) and P1.dtype == torch.float64
    assert torch.equal(P1, REF.r32(P1))
