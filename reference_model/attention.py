"""The attention of both versions (docs/research/dsv4-architecture.md §5; docs/v41-architecture.md §5.4): queries and
window KV, the compressed rows a layer sees and which of them each query reads, one sparse
softmax with the sink, the grouped output projection. What differs by version is a small
part chosen by the config (reference_model.version):

    q_rescale / window_kv   V4: per-head q rescale, FP8 nope dims; V4.1: none, FP8 all dims
    compressed              V4: every compressed layer its own compressor (+ CSA indexer);
                            V4.1: KV / index / candidate sources shared between layers
The GEMMs are the version's too (reference_model/gemm.py)."""
from __future__ import annotations

import torch

from .part import ModelPart


class Attention(ModelPart):
    """The shared skeleton; subclasses (attention_v4.V4Attention, v41/attention.py) fill in
    the version's steps. The model gives cfg, nx, gemm, the attention budget and RoPE tables."""

    # ---- the version's steps ---------------------------------------------------------------
    def new_state(self):
        raise NotImplementedError

    def q_rescale(self, q):
        raise NotImplementedError

    def window_kv(self, x, w: dict, rope):
        """The new tokens' window KV rows (after RoPE and their store)."""
        raise NotImplementedError

    def compressed(self, i, w, x, qr, state, pos, rope, inv, t, phase):
        """(compressed rows layer i reads or None, top-k picks [n, k] or None: all visible)."""
        raise NotImplementedError

    def after_layer(self, i: int, state, starts: list[int]) -> None:
        """Drop per-call scratch once layer i has run over the chunks starting at `starts`."""

    # ---- the skeleton -----------------------------------------------------------------------
    def __call__(self, i, w, x, state, pos0: int, t, phase):
        cfg, nx, m = self.cfg, self.nx, self.m
        st = state.layers[i]
        n = x.shape[0]
        ratio = cfg.compress_ratios[i]
        pos = torch.arange(pos0, pos0 + n, device=x.device)
        inv = m._inv_freq(ratio, x.device if m.devices else None)

        def rope(v, site, inverse=False):
            return nx.rope_apply(v, inv, pos, site, inverse, phase)

        qr = nx.rms_norm(m.gemm.lin(x, w, "attn.wq_a"), w["attn.q_norm.weight"], cfg.norm_eps)
        q = m.gemm.lin(qr, w, "attn.wq_b").view(n, cfg.n_heads, cfg.head_dim)
        q = rope(self.q_rescale(q), "q")
        kv = self.window_kv(x, w, rope)
        if t:
            t("attn.q", q), t("attn.kv", kv)
        comp, topk = (self.compressed(i, w, x, qr, state, pos, rope, inv, t, phase) if ratio
                      else (None, None))

        prev = st.window_kv
        n_prev = 0 if prev is None else prev.shape[0]
        allw = kv if prev is None else torch.cat([prev, kv], 0)       # [window rows | new rows]
        n_comp = 0 if comp is None else comp.shape[0]
        rows = torch.cat([allw, comp.to(x.device)], 0) if n_comp else allw
        idx = self.indices(pos, pos0, n_prev, n_prev + n, ratio, topk, n_comp)
        step = max(1, m.attn_budget // max(1, idx.shape[1] * cfg.head_dim))
        scale = cfg.head_dim ** -0.5
        o = torch.empty_like(q) if step < n else None       # steps written in place: no cat
        for a in range(0, n, step):
            part = nx.sparse_attention(q[a:a + step], rows, w["attn.attn_sink"], idx[a:a + step],
                                       scale, phase)
            if o is None:
                o = part.to(q.dtype)
            else:
                o[a:a + step].copy_(part)
        o = rope(o, "output", inverse=True)
        keep = cfg.window_size - 1                     # kept for the next chunk / decode step
        st.window_kv = allw[-keep:].clone() if keep > 0 else allw[:0].clone()

        g = cfg.o_groups
        wo_a = m.gemm.dq(w["attn.wo_a.weight"]).view(g, cfg.o_lora_rank, -1)
        u = nx.wo_a(o.reshape(n, g, -1), wo_a)
        return m.gemm.lin(u.reshape(n, -1), w, "attn.wo_b")

    def indices(self, pos, pos0, n_prev, comp_off, ratio, topk, n_comp):
        """Row indices into [window rows | new rows | compressed rows] for each query;
        -1 = empty. Window: positions t-W+1..t. Then the top-k picks, or (no picks: V4's
        HCA) every compressed entry j < (t+1)//ratio."""
        W = self.cfg.window_size
        dev = pos.device
        off = torch.arange(-(W - 1), 1, device=dev)                      # [W]
        wpos = pos.unsqueeze(1) + off                                     # absolute positions
        first = self.nx.window_first(pos, W).unsqueeze(1)
        widx = wpos - (pos0 - n_prev)
        # rows the state no longer holds (first < t-W+1 asks for them) stay invisible
        ok = (wpos >= first) & (wpos >= 0) & (widx >= 0)
        widx = torch.where(ok, widx, torch.full_like(widx, -1))
        parts = [widx]
        if topk is not None:
            topk = topk.to(dev)
            parts.append(torch.where(topk >= 0, topk + comp_off, topk))
        elif ratio and n_comp:
            j = torch.arange(n_comp, device=dev).unsqueeze(0)
            vis = j < self.nx.compressed_visible(pos, ratio).unsqueeze(1)
            parts.append(torch.where(vis, j + comp_off, torch.full_like(j, -1)).expand(len(pos), -1))
        return torch.cat(parts, 1)
