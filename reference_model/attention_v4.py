"""DeepSeek-V4's part of the attention (docs/research/dsv4-architecture.md §5): every compressed layer runs its own
compressor (ratio 4 overlapping, with a lightning indexer: CSA; other ratios dense: HCA)
on its own state; q gets a per-head RMS rescale and the window KV is FP8 on its nope dims."""
from __future__ import annotations

import torch

from .attention import Attention
from .state import CompressorState, SequenceState, cat


class V4Attention(Attention):

    def new_state(self):
        return SequenceState.empty(self.cfg)

    def q_rescale(self, q):
        return self.nx.q_head_rescale(q, self.cfg.norm_eps)

    def window_kv(self, x, w, rope):
        cfg, nx = self.cfg, self.nx
        kvn = nx.rms_norm(self.m.gemm.lin(x, w, "attn.wkv"), w["attn.kv_norm.weight"],
                          cfg.norm_eps, round_out=False)
        nope = cfg.nope_head_dim
        return torch.cat([nx.kv_store(kvn[:, :nope]), rope(nx.rs(kvn[:, nope:]), "kv")], -1)

    def compressed(self, i, w, x, qr, state, pos, rope, inv, t, phase):
        cfg = self.cfg
        st = state.layers[i]
        ratio = cfg.compress_ratios[i]
        pos0 = int(pos[0])
        new = self._compress(x, w, "attn.compressor.", ratio, cfg.head_dim, st.comp, pos0,
                             kind="kv", phase=phase)
        st.comp_kv = cat(st.comp_kv, new) if new.shape[0] else (
            st.comp_kv if st.comp_kv is not None else new)
        if t and new.shape[0]:
            t("attn.compressed_kv", new)
        topk = self._indexer(w, x, qr, st, pos, rope, t, phase) if ratio == 4 else None
        return st.comp_kv, topk

    # ---- compressor -----------------------------------------------------------------------
    def _compress(self, x, w, prefix, ratio, d, cs: CompressorState, pos0, kind, phase):
        """Feed new tokens to a compressor; returns the entries of groups completed now
        (post-processed: norm, RoPE at the group's first position, then the kind's store)."""
        cfg, nx = self.cfg, self.nx
        n = x.shape[0]
        kv, score = nx.compressor_proj(x, w[prefix + "wkv.weight"], w[prefix + "wgate.weight"])
        score = nx.compress_score_bias(score, w[prefix + "ape"], torch.arange(pos0, pos0 + n,
                                       device=x.device), ratio)
        kv, score = nx.compress_state(kv, score)
        kv, score = cat(cs.pending_kv, kv), cat(cs.pending_score, score)
        g = kv.shape[0] // ratio
        # clones: views would keep the whole chunk's projection alive in the state
        cs.pending_kv, cs.pending_score = kv[g * ratio:].clone(), score[g * ratio:].clone()
        if g == 0:
            return kv.new_zeros(0, d)
        gkv = kv[: g * ratio].view(g, ratio, -1)
        gsc = score[: g * ratio].view(g, ratio, -1)
        if ratio == 4:                       # overlapping: previous group's [0:d] + current [d:2d]
            if cs.prev_kv is None:
                pkv0 = gkv.new_zeros(1, ratio, 2 * d)
                psc0 = gsc.new_full((1, ratio, 2 * d), float("-inf"))
            else:
                pkv0, psc0 = cs.prev_kv.unsqueeze(0), cs.prev_score.unsqueeze(0)
            pkv = torch.cat([pkv0, gkv[:-1]], 0)
            psc = torch.cat([psc0, gsc[:-1]], 0)
            ckv = torch.cat([pkv[..., :d], gkv[..., d:]], 1)
            csc = torch.cat([psc[..., :d], gsc[..., d:]], 1)
            cs.prev_kv, cs.prev_score = gkv[-1].clone(), gsc[-1].clone()
        else:
            ckv, csc = gkv, gsc
        pooled = nx.compress_pool(ckv, csc)                                   # [g, d]
        first = nx.compressed_positions(cs.n_groups + torch.arange(g, device=x.device), ratio)
        cs.n_groups += g
        normed = nx.rms_norm(nx.rs(pooled), w[prefix + "norm.weight"], cfg.norm_eps, round_out=False)
        inv = self.m._inv_freq(ratio, x.device if self.m.devices else None)
        r = cfg.rope_head_dim
        if kind == "kv":
            return torch.cat([nx.kv_store(normed[:, :-r]),
                              nx.rope_apply(nx.rs(normed[:, -r:]), inv, first, "compressed_kv",
                                            phase=phase)], -1)
        k = nx.rope_apply(nx.rs(normed), inv, first, "index_k", phase=phase)
        return nx.index_key_store(k)

    # ---- lightning indexer ----------------------------------------------------------------
    def _indexer(self, w, x, qr, st, pos, rope, t, phase):
        cfg, nx = self.cfg, self.nx
        n = x.shape[0]
        pos0 = int(pos[0])
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = nx.fp8_linear(qr, w["attn.indexer.wq_b.weight"]).view(n, h, d)
        q = nx.index_query(rope(q, "index_q"))
        new = self._compress(x, w, "attn.indexer.compressor.", 4, d, st.index_comp, pos0,
                             kind="index", phase=phase)
        if new.shape[0]:
            st.index_keys = cat(st.index_keys, new)
            if t:
                t("attn.index.keys", new)
        wts = nx.bf16_linear(x, w["attn.indexer.weights_proj.weight"])
        wts = nx.index_weights(wts, d ** -0.5 * h ** -0.5)
        keys = st.index_keys
        n_keys = 0 if keys is None else keys.shape[0]
        # fixed width index_topk (-1 padded) so picks of different chunks line up
        out = torch.full((n, cfg.index_topk), -1, dtype=torch.long, device=x.device)
        if n_keys == 0:
            if t:       # no entry yet (a short chunk, a decode step): the rows still line up
                t("attn.index.topk", out)
            return out
        visible = nx.compressed_visible(pos, 4)
        k = min(cfg.index_topk, n_keys)
        step = max(1, self.m.attn_budget // max(1, h * n_keys))
        for a in range(0, n, step):
            b = min(a + step, n)
            s, picks = nx.index_select(q[a:b], keys, wts[a:b], visible[a:b], k)
            if picks.shape[1] > out.shape[1]:     # an engine keeping more entries (index_topk_override)
                out = torch.cat([out, out.new_full((n, picks.shape[1] - out.shape[1]), -1)], 1)
            out[a:b, :picks.shape[1]] = picks
        if t:
            t("attn.index.topk", out)
            # the chunk's last query's scores over every key (-inf: not visible): at the
            # prompt's end, how close each entry sits to the top-k boundary (selection margins)
            t("attn.index.last_scores", s[-1:])
        return out
