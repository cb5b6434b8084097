"""Mutation suite: one-line bugs of the kinds engines ship, each a user toggle on the seam.

Load it like any plugin (`fidelity ab --plugin tests/mutations/bugs.py --arm mut_...`).
It is the proof that the seam reaches every step (each bug is expressible as a toggle
without touching the model) and that the verdict works: tests/test_mutations.py runs them
on the trained tiny model and checks each is named with the right first divergent layer.

EXPECTED[name] = (first layer where the bug acts, phase where it first shows, note).
Tiny model: layer 0 window-only + hash routing, 1 CSA + hash routing, 2 HCA, 3 CSA, 4 HCA;
layer 5 = the final logits; window 32, index_topk 16 (entries = positions / 4)."""
from __future__ import annotations

import torch

from kernel_toggles import toggle

EXPECTED: dict[str, tuple[int, str, str]] = {}


def mutation(name, kernel, layer, phase="prefill", note="", wraps=True):
    """Register `fn` as a known-bug toggle on `kernel` and record where it should show.
    wraps=False for bugs that do not build on golden.<kernel> (they refuse to combine with
    an engine toggle on the same kernel instead of silently shadowing it)."""
    def deco(fn):
        EXPECTED[name] = (layer, phase, note)
        return toggle(name, kernel=kernel, category="known-bug", wraps=wraps,
                      description=f"Mutation: {fn.__doc__}")(fn)
    return deco


def _rotate_half(x, table, inverse=False):
    """RoPE in the split-half (NeoX) layout instead of V4's interleaved pairs."""
    r = table.shape[-1] * 2
    t = table.conj() if inverse else table
    while t.dim() < x.dim():
        t = t.unsqueeze(-2)
    a, b = x[..., -r:-r // 2], x[..., -r // 2:]
    z = torch.complex(a, b) * t.to(torch.complex128)
    return torch.cat([x[..., :-r], z.real.to(x.dtype), z.imag.to(x.dtype)], -1)


# ---- RoPE application and positions ----------------------------------------------------
@mutation("mut_rope_q_half_layout", "rope_apply", 0, note="query RoPE in split-half layout", wraps=False)
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """query rotated in the split-half layout (the V3.2 indexer fix carried over)."""
    from reference_model import primitives as P
    return g.rs(_rotate_half(x, P.rope_table(pos, inv))) if site == "q" else g.rope_apply(x, inv, pos, site, inverse, phase)


@mutation("mut_rope_no_output_inverse", "rope_apply", 0, note="Primus #928")
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """inverse RoPE on the attention output skipped."""
    return g.rs(x) if site == "output" else g.rope_apply(x, inv, pos, site, inverse, phase)


@mutation("mut_rope_index_k_half_layout", "rope_apply", 1, note="indexer keys only", wraps=False)
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """indexer keys rotated in the split-half layout, queries interleaved."""
    from reference_model import primitives as P
    return g.rs(_rotate_half(x, P.rope_table(pos, inv))) if site == "index_k" else g.rope_apply(x, inv, pos, site, inverse, phase)


@mutation("mut_rope_index_q_inverse", "rope_apply", 1)
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """indexer query rotated backwards (conjugate table)."""
    return g.rope_apply(x, inv, pos, site, not inverse if site == "index_q" else inverse, phase)


@mutation("mut_rope_decode_position_plus_one", "rope_apply", 0, "decode",
          note="decode position = sequence length, not length - 1")
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """decode steps rotate at position + 1 (off-by-one sequence length)."""
    return g.rope_apply(x, inv, pos + 1 if phase == "decode" else pos, site, inverse, phase)


@mutation("mut_rope_q_positions_wrap_256", "rope_apply", 0, note="long context only: positions >= 256")
def _(g, x, inv, pos, site, inverse=False, phase="prefill"):
    """query RoPE positions taken modulo a 256-row table (keys keep theirs)."""
    return g.rope_apply(x, inv, pos % 256 if site == "q" else pos, site, inverse, phase)


@mutation("mut_compressed_rope_last_token", "compressed_positions", 1, note="Primus #928 class", wraps=False)
def _(g, groups, ratio):
    """compressed entries rotated at their group's last token instead of its first."""
    return groups * ratio + ratio - 1


@mutation("mut_compressed_visible_late", "compressed_visible", 1, wraps=False)
def _(g, positions, ratio):
    """a compressed entry becomes visible one token after its group completes."""
    return positions // ratio


@mutation("mut_window_one_short", "window_first", 0, wraps=False)
def _(g, positions, window):
    """sliding window one row short (127 of 128)."""
    return positions - (window - 2)


@mutation("mut_ape_off_by_one", "compress_score_bias", 1)
def _(g, score, ape, positions, ratio):
    """compressor position bias indexed with t + 1."""
    return g.compress_score_bias(score, ape, positions + 1, ratio)


@mutation("mut_compress_pool_mean", "compress_pool", 1, wraps=False)
def _(g, kv, score):
    """compressor pools with a plain mean instead of the gated softmax."""
    return g.r32(kv.mean(1))


# ---- lightning indexer --------------------------------------------------------------------
@mutation("mut_index_topk_half", "index_topk", 1, note="acts once entries > index_topk / 2")
def _(g, scores, k):
    """indexer keeps only half of index_topk."""
    out = g.index_topk(scores, k)
    return torch.where(torch.arange(k) < k // 2, out, torch.full_like(out, -1))


@mutation("mut_index_drop_last_pick", "index_topk", 1, note="mechanism: one pick of k lost")
def _(g, scores, k):
    """indexer's k-th best entry replaced by the (k+1)-th (a merge of partial top-k lists
    off by one)."""
    top = g.index_topk(scores, k)
    vals = torch.gather(scores, -1, top.clamp(min=0)).masked_fill(top < 0, float("inf"))
    worst = top.gather(-1, vals.argmin(-1, keepdim=True))
    hide = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, worst.clamp(min=0), True) & (worst >= 0)
    return g.index_topk(scores.masked_fill(hide, float("-inf")), k)


@mutation("mut_index_hides_newest_entry", "index_topk", 1, note="mechanism: indexer one group behind")
def _(g, scores, k):
    """the newest visible compressed entry hidden from the indexer (its key cache one group
    behind the compressor)."""
    visible = torch.isfinite(scores)
    last = visible.long().cumsum(-1).argmax(-1, keepdim=True)        # last finite column per row
    hide = torch.zeros_like(visible).scatter(-1, last, True) & visible
    return g.index_topk(scores.masked_fill(hide, float("-inf")), k)


@mutation("mut_index_first_64_entries", "index_scores", 1, note="long context only: > 64 entries")
def _(g, q, keys, w):
    """indexer scores only the first 64 compressed entries (a capped score buffer)."""
    s = g.index_scores(q, keys, w)
    return s.masked_fill(torch.arange(s.shape[-1]) >= 64, float("-inf"))


@mutation("mut_index_no_relu", "index_scores", 1, wraps=False)
def _(g, q, keys, w):
    """indexer head scores summed without the ReLU."""
    return g.rs(g.rs(torch.einsum("chd,nd->chn", q.to(g.cd), keys.to(g.cd)) * w.unsqueeze(-1)).sum(1))


@mutation("mut_index_weights_abs", "index_weights", 1)
def _(g, w, scale):
    """indexer head weights taken in absolute value (sign lost)."""
    return g.index_weights(w.abs(), scale)


# ---- attention ----------------------------------------------------------------------------
@mutation("mut_attention_no_sink", "sparse_attention", 0)
def _(g, q, kv, sink, idx, scale, phase="prefill"):
    """attention sink left out of the softmax denominator."""
    return g.sparse_attention(q, kv, torch.full_like(sink, -1e30), idx, scale, phase)


@mutation("mut_decode_attention_scale", "sparse_attention", 0, "decode", note="decode kernel only")
def _(g, q, kv, sink, idx, scale, phase="prefill"):
    """decode attention kernel uses the softmax scale of a 576-dim head (V3 MLA)."""
    return g.sparse_attention(q, kv, sink, idx, 576 ** -0.5 if phase == "decode" else scale, phase)


@mutation("mut_q_rescale_missing", "q_head_rescale", 0, wraps=False)
def _(g, q, eps):
    """per-head RMS rescale of q skipped."""
    return q


@mutation("mut_rms_norm_eps", "rms_norm", 0)
def _(g, x, w, eps, round_out=True):
    """RMSNorm with eps 1e-2 instead of 1e-6."""
    return g.rms_norm(x, w, 1e-2, round_out)


# ---- mHC ----------------------------------------------------------------------------------
@mutation("mut_hc_comb_transposed", "hc_post", 0)
def _(g, a, H, post, comb):
    """mHC residual mix applied with comb transposed (source/destination swapped)."""
    return g.hc_post(a, H, post, comb.transpose(-1, -2))


# ---- MoE ----------------------------------------------------------------------------------
@mutation("mut_moe_select_no_bias", "moe_select", 2, note="first score-routed layer")
def _(g, scores, bias, tokens, tid2eid, k, layer, hash_layer):
    """router ignores the selection bias."""
    return g.moe_select(scores, None if bias is None else bias * 0, tokens, tid2eid, k, layer, hash_layer)


@mutation("mut_hash_layers_scored", "moe_select", 0)
def _(g, scores, bias, tokens, tid2eid, k, layer, hash_layer):
    """hash layers routed by top-k of the scores (tid2eid ignored)."""
    return torch.topk(scores, k, dim=-1).indices if hash_layer else g.moe_select(scores, bias, tokens, tid2eid, k, layer, hash_layer)


@mutation("mut_route_weights_biased", "route_weights", 2)
def _(g, scores, idx, bias, route_scale, renormalize=True):
    """routing weights taken from the biased scores."""
    return g.route_weights(scores if bias is None else scores + bias.to(scores.dtype), idx, bias, route_scale, renormalize)


@mutation("mut_route_no_renormalize", "route_weights", 0)
def _(g, scores, idx, bias, route_scale, renormalize=True):
    """routing weights not renormalised over the picked experts."""
    return g.route_weights(scores, idx, bias, route_scale, False)


@mutation("mut_swiglu_swapped", "swiglu", 0)
def _(g, gate, up, limit):
    """SwiGLU with gate and up projections swapped."""
    return g.swiglu(up, gate, limit)


@mutation("mut_shared_expert_dropped", "moe_combine", 0)
def _(g, routed_sum, shared):
    """shared expert output not added."""
    return g.moe_combine(routed_sum, None)


# ---- head ---------------------------------------------------------------------------------
@mutation("mut_lm_head_scaled", "lm_head", 5, note="final logits only")
def _(g, x, w):
    """logits scaled by 1.25 (a stray temperature)."""
    return g.lm_head(x, w) * 1.25
