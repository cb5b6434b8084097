"""The steps DeepSeek-V4.1 adds, as pure functions of tensors and config values
(docs/v41-architecture.md §4, §5), in the reference reading; the V4.1 model calls them
through the seam, so each can be replaced by a toggle.

Every function takes `nx` first: a reference_model.numerics.Numerics (or anything with its
`rs` / `r32` / `c` / `quant` / `cd`), so the same code is the `reference` profile (bf16
storage between steps, simulated FP8/FP4, computed in fp64 or fp32) and the `exact` profile
(no rounding, no quantisation). Tensors travel in nx's compute dtype holding values already
rounded where the reference rounds, as in V4's Numerics.

    Engram        compress_history, engram_hash, engram_lookup, engram_gate, engram
    GEMMs         fp8_linear32 (1x32 ue8m0 activation quant), bf16_linear
    compressors   compressor_pool2 (ratio 2: disjoint pairs, fp32 softmax gate), compressor_proj1
                  (ratio 1: per-token wkv), compressor_norm
    indexer       index_keys (k_norm(wk(latent)) + RoPE + FP4), index_query, index_weights,
                  index_visible_mask, candidate_blocks, index_topk
    mHC (lagged)  identity_pre_mix, hc_mix, hc_collapse, lagged_block, head_collapse
    KV storage    window_kv_store (FP8, 1x32 ue8m0), compressed_kv_store (FP4, 1x16 e4m3
                  scales), compressed_entries (RoPE at j·r, then the store), fp4_e4m3_qdq"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import primitives as P
from .. import quant as Q
from ..primitives import sinkhorn_split, topk_lowest_index_ties
from .engram_table import EngramTable

DEAD = -1                       # Engram history entry of an image-span token
ACT_BLOCK = 32                  # activation quant before FP8/FP4 GEMMs, window KV, index q/k
CKV_BLOCK = 16                  # compressed KV FP4 blocks (E4M3 scales)
E4M3_MIN_SUB = 2.0 ** -9        # smallest e4m3 subnormal: floor of the FP4/E4M3 block scale
ENGRAM_GATE_FLOOR = 1e-6        # |dot| floor inside the signed square root


# ---- Engram: hashing ------------------------------------------------------------------------
def compress_history(token_ids: torch.Tensor, token_map, dead: torch.Tensor | None = None) -> torch.Tensor:
    """Compressed id per position (the Engram history): token_map[id], DEAD where `dead`
    (image-span tokens). token_map: list or LongTensor of compressed ids."""
    tm = torch.as_tensor(token_map, dtype=torch.long, device=token_ids.device)
    h = tm[token_ids.long()]
    return h if dead is None else torch.where(dead, torch.full_like(h, DEAD), h)


def engram_hash(hist: torch.Tensor, positions: torch.Tensor, layout, pad_c: int) -> torch.Tensor:
    """Row ids [s, n_engram_layers, (N-1)·heads] of the positions' n-grams (REF-E
    `NgramHashState.forward`). hist[p] = compressed id at absolute position p (DEAD = -1),
    covering every position from 0 to max(positions). Looking back s = 0..N-1 tokens, an
    n-gram is blocked (its remaining tokens become pad_c) from the first look-back that
    falls before position 0 or on a DEAD token, and stays blocked. Then per layer, in int64:
    rolling = tok0·m0, rolling ^= tok_i·m_i (now the (i+1)-gram), id = rolling mod prime +
    column offset. Multipliers are bounded so token·m < 2^63: nothing overflows."""
    pos = positions.long()
    hist = hist.long()
    N = layout.max_ngram
    blocked = torch.zeros_like(pos, dtype=torch.bool)
    toks = []
    for s in range(N):
        src = hist[(pos - s).clamp(min=0)]
        blocked = blocked | (pos < s) | (src == DEAD)
        toks.append(torch.where(blocked, torch.full_like(src, pad_c), src))
    out = []
    for k in range(len(layout.layer_ids)):
        m = layout.multipliers[k]
        rolling = toks[0] * m[0]
        cols = []
        for i in range(1, N):
            rolling = rolling ^ (toks[i] * m[i])
            for h, prime in enumerate(layout.primes[k][i - 1]):
                cols.append(rolling % prime + layout.offsets[k][(i - 1) * layout.n_heads + h])
        out.append(torch.stack(cols, -1))
    return torch.stack(out, 1)


# ---- Engram: lookup and gate ----------------------------------------------------------------
def engram_lookup(nx, table, ids: torch.Tensor) -> torch.Tensor:
    """Rows [.., head_dim] of an Engram table (EngramTable: e4m3 · E8M0 per 32 channels, in
    fp32, then bf16 -- exact, gathered on the host and moved to ids' device; or a dense
    tensor of those values) in the compute dtype."""
    rows = table.lookup(ids) if isinstance(table, EngramTable) else table[ids.long()]
    return nx.c(rows)


def engram_gate(nx, H, kv, q_weight, k_weight, eps: float, token_mask=None):
    """H_k += g_k · value per stream k (doc §5.2): kv = wkv(rows) [s, (hc+1)·d] holds one key
    per stream and one shared value; w = q_weight·k_weight (fp32, only the product is
    used); dot_k = Σ_d X_k·w_k·key_k · rsqrt(mean X_k² + eps) · rsqrt(mean key_k² + eps) ·
    d^-½, normalised per (token, stream) over the d channels; g = sigmoid(sign(dot) ·
    sqrt(max(|dot|, 1e-6))), 0 where token_mask is False. H [s, hc, d] -> bf16 values."""
    s, hc, d = H.shape
    X = nx.c(H)
    kv = nx.c(kv)
    key, value = kv[:, : hc * d].view(s, hc, d), kv[:, hc * d:]
    w = nx.r32(q_weight.to(nx.cd) * k_weight.to(nx.cd))
    rx = torch.rsqrt(X.square().mean(-1) + eps)
    rk = torch.rsqrt(key.square().mean(-1) + eps)
    dot = nx.r32((X * w * key).sum(-1) * rx * rk * d ** -0.5)
    g = nx.r32(torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=ENGRAM_GATE_FLOOR).sqrt()))
    if token_mask is not None:
        g = g * token_mask.to(g.dtype).unsqueeze(-1)
    return nx.rs(X + g.unsqueeze(-1) * value.unsqueeze(1))


def engram(nx, H, ids, table, wkv, q_weight, k_weight, eps: float, token_mask=None):
    """One Engram layer on the residual streams: the token's hashed rows [s, cols] looked up,
    flattened, projected by wkv (FP8 32x32, 1x32 act quant, bf16 out), then the gate."""
    rows = engram_lookup(nx, table, ids)
    kv = fp8_linear32(nx, rows.flatten(1), wkv)
    return engram_gate(nx, H, kv, q_weight, k_weight, eps, token_mask)


# ---- GEMMs ----------------------------------------------------------------------------------
def fp8_linear32(nx, x, w):
    """FP8/FP4-weight GEMM of V4.1: FP8 act-quant of the bf16 input in 1x32 blocks (ue8m0),
    fp32 accumulate, bf16 out. `w` holds the dequantised weight values."""
    if nx.quant:
        x = Q.fp8_qdq(x, ACT_BLOCK)
    return nx.rs(nx.c(x) @ nx.c(w).T)


def bf16_linear(nx, x, w):
    """bf16 GEMM (fp32 accumulate), bf16 out."""
    return nx.rs(nx.c(x) @ nx.c(w).T)


# ---- compressors ----------------------------------------------------------------------------
def compressor_proj2(nx, x, wkv, wgate):
    """Ratio-2 compressor projections: fp32 GEMMs of the bf16 input with the bf16 weights
    up-cast: (K, G) [n, head_dim] fp32."""
    xc = nx.c(x)
    return nx.r32(xc @ nx.c(wkv).T), nx.r32(xc @ nx.c(wgate).T)


def compressor_pool2(nx, K, G, pending=None):
    """Disjoint pairs (no overlap, no ape): group j = tokens {2j, 2j+1}; per channel
    w = softmax over the pair of G (fp32); c_j = Σ w ⊙ K (fp32). `pending` = (K, G) of an
    open group's first token from an earlier call (fp32 state). Returns (pooled [groups,
    d] fp32 values, new pending or None): a group is emitted once its last token is in."""
    if pending is not None:
        K, G = torch.cat([pending[0], K]), torch.cat([pending[1], G])
    n = K.shape[0] // 2 * 2
    rest = (K[n:], G[n:]) if K.shape[0] > n else None
    Kp, Gp = K[:n].unflatten(0, (-1, 2)), G[:n].unflatten(0, (-1, 2))
    w = torch.softmax(Gp, dim=1)
    return nx.r32((w * Kp).sum(1)), rest


def compressor_proj1(nx, x, wkv):
    """Ratio 1: a plain bf16 projection per token (REF keeps this wkv in bf16), bf16 out."""
    return bf16_linear(nx, x, wkv)


def compressor_norm(nx, c, norm_w, eps: float):
    """latent = cmp_norm(bf16(c)): the pooled fp32 value (ratio 2) or the bf16 projection
    (ratio 1) rounded to bf16, RMSNorm in fp32 with the weight, one cast (REF reading; D3's
    alternative normalises the fp32 value directly). Before RoPE."""
    return nx.rms_norm(nx.rs(c), norm_w, eps)


# ---- KV storage -----------------------------------------------------------------------------
def window_kv_store(nx, kv):
    """Window KV after RoPE: FP8 e4m3 round trip of ALL head dims (RoPE tail included) in
    1x32 blocks with ue8m0 scales (V4 quantised only the nope dims, in 64-blocks)."""
    kv = nx.rs(kv)
    return nx.c(Q.fp8_qdq(kv, ACT_BLOCK)) if nx.quant else kv


def fp4_e4m3_qdq(x: torch.Tensor, block: int = CKV_BLOCK) -> torch.Tensor:
    """FP4 e2m1 round trip with one E4M3 scale per `block` channels (`fp4_act_quant(x, 16,
    scale_dtype=float8_e4m3fn)`): amax floored at 6·2^-9; s = e4m3(amax/6) rounded to
    nearest (not a power of two), kept in [2^-9, 448] as vLLM clamps it; q = e2m1 nearest-
    even of clamp(x/s, ±6); result q·s (fp32, exact). DeepSeek's kernel itself was not read
    (doc §13); four CPU ports and two engines agree on this recipe."""
    xb = Q._blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=Q.FP4_MAX * E4M3_MIN_SUB)
    s = (amax / Q.FP4_MAX).clamp(E4M3_MIN_SUB, Q.FP8_MAX).to(torch.float8_e4m3fn).float()
    q = Q.round_to_e2m1((xb / s).clamp(-Q.FP4_MAX, Q.FP4_MAX))
    return (q * s).flatten(-2)


def compressed_kv_store(nx, latent_roped):
    """Compressed KV entry after RoPE at the group's first token: FP4 over all head dims in
    1x16 blocks with E4M3 scales, kept as bf16 values."""
    x = nx.rs(latent_roped)
    return nx.rs(fp4_e4m3_qdq(x, CKV_BLOCK)) if nx.quant else x


# ---- RoPE helper ----------------------------------------------------------------------------
def rope(nx, x, inv_freq, positions, inverse: bool = False):
    """Interleaved RoPE on the last 2·len(inv_freq) dims at `positions`, storage-rounded."""
    table = P.rope_table(positions, inv_freq.to(positions.device))
    return nx.rs(P.apply_rope(x, table, inverse))


def compressed_entries(nx, latent, inv_freq, groups, ratio: int):
    """Compressed KV entries e_j of a KV source: its pre-RoPE latents rotated at the group's
    first token j·ratio (compress RoPE table), then `compressed_kv_store`."""
    return compressed_kv_store(nx, rope(nx, latent, inv_freq, groups.long() * ratio))


# ---- indexer --------------------------------------------------------------------------------
def index_keys(nx, latent, wk, k_norm_w, eps: float, inv_freq, positions):
    """Index keys of a KV source from its pre-RoPE latents: k = k_norm(wk(latent)) (bf16
    GEMM, RMSNorm), RoPE on the tail at the group's first token j·r (`positions`), then an
    FP4 round trip in 1x32 blocks with ue8m0 scales. No Hadamard (V4 had one)."""
    k = nx.rms_norm(bf16_linear(nx, latent, wk), k_norm_w, eps)
    k = rope(nx, k, inv_freq, positions)
    return nx.c(Q.fp4_qdq(k, ACT_BLOCK)) if nx.quant else k


def index_query(nx, qr, wq_b, inv_freq, positions, n_heads: int):
    """Indexer query: wq_b(qr) (FP8 GEMM) as [s, heads, d], RoPE on the tail at t, FP4
    round trip (1x32, ue8m0). No Hadamard."""
    q = fp8_linear32(nx, qr, wq_b).unflatten(-1, (n_heads, -1))
    q = rope(nx, q, inv_freq, positions)
    return nx.c(Q.fp4_qdq(q, ACT_BLOCK)) if nx.quant else q


def index_weights(nx, x, weights_proj, n_heads: int, head_dim: int):
    """Per-head score weights: bf16 weights_proj(x) times head_dim^-½ · n_heads^-½ (bf16)."""
    return nx.rs(bf16_linear(nx, x, weights_proj) * (head_dim ** -0.5 * n_heads ** -0.5))


def index_visible_mask(scores, positions, ratio: int):
    """-inf where entry j is not yet complete for query t: j >= (t+1)//ratio (for ratio 1
    the query's own latent is visible)."""
    n = scores.shape[-1]
    vis = (positions.long() + 1) // ratio
    j = torch.arange(n, device=scores.device)
    return scores.masked_fill(j.unsqueeze(0) >= vis.unsqueeze(1), float("-inf"))


def candidate_blocks(scores, positions, ratio: int, block: int, topk_blocks: int):
    """The candidate source's block mask C [c, n] (REF `select_candidate_blocks`): pad the
    position axis with -inf to a multiple of `block`; block score = max of its positions;
    the block holding the newest visible position (t+1)//ratio - 1 is always kept (+inf);
    keep the top min(topk_blocks, n_blocks) blocks whose score is finite-or-+inf (ties by
    the lower block index); expand back to positions. `scores` are already visibility-masked."""
    c, n = scores.shape
    if n == 0:                                   # no compressed entry yet
        return torch.zeros(c, 0, dtype=torch.bool, device=scores.device)
    nb = -(-n // block)
    padded = F.pad(scores, (0, nb * block - n), value=float("-inf"))
    bs = padded.view(c, nb, block).amax(-1)
    newest = (positions.long() + 1) // ratio - 1
    has = newest >= 0
    nb_idx = (newest.clamp(min=0) // block).clamp(max=nb - 1)
    bs = bs.clone()
    bs[has, nb_idx[has]] = float("inf")
    pick = topk_lowest_index_ties(bs, min(topk_blocks, nb))          # -1 where -inf
    keep = torch.zeros(c, nb, dtype=torch.bool, device=scores.device)
    ok = pick >= 0
    rows = torch.arange(c, device=scores.device).unsqueeze(1).expand_as(pick)
    keep[rows[ok], pick[ok]] = True
    return keep.repeat_interleave(block, 1)[:, :n]


def index_topk(scores, k: int, candidates=None):
    """Top-k entries per query, restricted to the candidate mask when given: K = min(k, n),
    ties by the lower position, ascending positions, -1 for picks whose score is -inf (not
    visible or not a candidate: HF's reading, the default of doc §9 D9)."""
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    return topk_lowest_index_ties(scores, min(k, scores.shape[-1]))


# ---- lagged mHC ---------------------------------------------------------------------------
def identity_pre_mix(n: int, hc: int, dtype=torch.float32, device=None):
    """P_0: every token collapses onto stream 0 at the first site (`make_identity_pre_mix`)."""
    p = torch.zeros(n, hc, dtype=dtype, device=device)
    p[:, 0] = 1
    return p


def hc_mix(nx, H, fn, scale, base, hc_sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """A site's mixes without the collapse: m = (X·fnᵀ)·rsqrt(mean X² + norm_eps) over the
    flattened streams (fp32), then the Sinkhorn split -> (pre, post, comb), fp32."""
    n, hc, d = H.shape
    X = nx.c(H).reshape(n, hc * d)
    m = nx.r32((X @ nx.c(fn).T) * torch.rsqrt(X.square().mean(-1, keepdim=True) + norm_eps))
    pre, post, comb = sinkhorn_split(m, nx.c(scale), nx.c(base), hc, hc_sinkhorn_iters, hc_eps)
    return nx.r32(pre), nx.r32(post), nx.r32(comb)


def hc_collapse(nx, H, pre):
    """bf16(Σ_j pre_j · H_j) in fp32: the streams collapsed with a GIVEN pre-mix."""
    return nx.rs((nx.c(pre).unsqueeze(-1) * nx.c(H)).sum(1))


def lagged_block(nx, H, P, w: dict, cfg, attn, ffn, engram_fn=None):
    """One V4.1 block's residual bookkeeping (doc §5.3): each site computes its own mixes
    from its input streams, but collapses with the PREVIOUS site's pre-mix (the attention
    with P from the last block, the FFN with the attention's pre); returns (H, P_next = the
    FFN's pre). `attn` / `ffn` map the normed collapsed input [s, d] to [s, d]; `engram_fn`
    updates H first on Engram layers. `w` holds the layer's hc_*, attn_norm, ffn_norm."""
    mix = dict(hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    if engram_fn is not None:
        H = engram_fn(H)
    pre_a, post_a, comb_a = hc_mix(nx, H, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], **mix)
    a = attn(nx.rms_norm(hc_collapse(nx, H, P), w["attn_norm.weight"], cfg.norm_eps))
    H = nx.hc_post(a, H, post_a, comb_a)
    pre_f, post_f, comb_f = hc_mix(nx, H, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], **mix)
    f = ffn(nx.rms_norm(hc_collapse(nx, H, pre_a), w["ffn_norm.weight"], cfg.norm_eps))
    return nx.hc_post(f, H, post_f, comb_f), pre_f


def head_collapse(nx, H, P, norm_w, eps: float):
    """The head's input: norm(collapse(H, P_last)) with the last FFN's pre (no hc_head)."""
    return nx.rms_norm(hc_collapse(nx, H, P), norm_w, eps)
