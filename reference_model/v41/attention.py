"""DeepSeek-V4.1's part of the attention (docs/v41-architecture.md §5.4, §11): compressed
KV and index keys are owned by the KV-source layers and read by every later compressed
layer of the same ratio; top-k is computed on index sources and reused by the layers after
them; the candidate source's blocks restrict later index sources. No q rescale; the
window KV is FP8 over all dims. The shared skeleton is reference_model/attention.py."""
from __future__ import annotations

import torch

from ..attention import Attention
from ..state import cat
from .state import V41SequenceState


class SourcedAttention(Attention):

    def __init__(self, model):
        super().__init__(model)
        cfg = model.cfg
        # the last layer that reads each index source's top-k / the candidate source's
        # blocks: after it has run, the per-call picks are dropped
        self._last_topk_reader = {}
        for i in range(cfg.n_layers):
            s = cfg.index_source(i)
            if s is not None:
                self._last_topk_reader[s] = i
        users = [i for i in range(cfg.n_layers) if cfg.uses_candidates(i)]
        self._last_block_reader = users[-1] if users else None

    def new_state(self):
        return V41SequenceState.empty(self.cfg)

    def q_rescale(self, q):
        return self.nx.q_head_norm(q, self.cfg.norm_eps)

    def window_kv(self, x, w, rope):
        nx = self.nx
        kv = nx.rms_norm(self.m.gemm.lin(x, w, "attn.wkv"), w["attn.kv_norm.weight"], self.cfg.norm_eps)
        return nx.window_kv_store(rope(kv, "kv"))

    def compressed(self, i, w, x, qr, state, pos, rope, inv, t, phase):
        cfg = self.cfg
        pos0 = int(pos[0])
        src = cfg.kv_source(i)
        if i == src:
            self._compress(i, w, x, state, pos0, inv, t, phase)
        if i in cfg.index_source_layers:
            topk = self._indexer(i, w, x, qr, state, pos, rope, t, phase)
        else:
            topk = state.layers[cfg.index_source(i)].topk[pos0]
        return state.layers[src].comp_kv, topk

    def after_layer(self, i: int, state, starts: list[int]) -> None:
        """Per-call top-k / candidate blocks are kept only until their last reader ran; only
        this call's chunks (`starts`) are dropped, so layer-major callers that interleave
        calls of one sequence (needle's head then last token, layer by layer) keep the rest."""
        for s, last in self._last_topk_reader.items():
            if last == i:
                for a in starts:
                    state.layers[s].topk.pop(a, None)
        if self._last_block_reader == i:
            blocks = state.layers[self.cfg.candidate_source_layer].blocks
            for a in starts:
                blocks.pop(a, None)

    # ---- KV sources: compressor, compressed entries, index keys --------------------------------
    def _compress(self, i, w, x, state: V41SequenceState, pos0, inv, t, phase):
        """Feed the chunk to layer i's compressor; append the groups completed now to its
        compressed cache (RoPE at the group's first token, FP4/16) and its index keys."""
        cfg, nx = self.cfg, self.nx
        st = state.layers[i]
        r = cfg.compress_ratios[i]
        p = "attn.compressor."
        if r == 2:
            Kp, Gp = nx.compressor_proj2(x, w[p + "wkv.weight"], w[p + "wgate.weight"])
            pooled, st.pending = nx.compressor_pool2(Kp, Gp, st.pending)
        else:
            pooled = nx.compressor_proj1(x, w[p + "wkv.weight"])
        g = pooled.shape[0]
        st.fresh = g > 0
        if g == 0:
            return
        latent = nx.compressor_norm(pooled, w[p + "norm.weight"], cfg.norm_eps)
        first = nx.compressed_positions(st.n_groups + torch.arange(g, device=x.device), r)
        st.n_groups += g
        entries = nx.compressed_kv_store(nx.rope_apply(latent, inv, first, "compressed_kv",
                                                       phase=phase))
        k = nx.index_key(latent, w["attn.indexer.wk.weight"], w["attn.indexer.k_norm.weight"],
                         cfg.norm_eps)
        k = nx.index_fp4(nx.rope_apply(k, inv, first, "index_k", phase=phase), "k")
        st.comp_kv = cat(st.comp_kv, entries)
        st.index_keys = cat(st.index_keys, k)
        state.key_writer = i
        if t:
            t("attn.compressed_kv", entries), t("attn.index_keys", k)

    # ---- indexer ------------------------------------------------------------------------------
    def _indexer(self, i, w, x, qr, state: V41SequenceState, pos, rope, t, phase):
        """Index source i: scores of its query against its KV source's index keys, masked
        to visible entries (and, after the candidate source, to the candidate blocks);
        top-k per query, kept for the layers after it in this call."""
        cfg, nx = self.cfg, self.nx
        n = x.shape[0]
        pos0 = int(pos[0])
        ratio = cfg.compress_ratios[i]
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = self.m.gemm.lin(qr, w, "attn.indexer.wq_b").view(n, h, d)
        q = nx.index_fp4(rope(q, "index_q"), "q")
        wts = nx.index_weights(nx.bf16_linear(x, w["attn.indexer.weights_proj.weight"]),
                               d ** -0.5 * h ** -0.5)
        own = cfg.kv_source(i)
        src = nx.index_key_source(i, own, state.layers[own].fresh, state.key_writer)
        keys = state.layers[src].index_keys
        n_keys = 0 if keys is None else keys.shape[0]
        out = torch.full((n, cfg.index_topk), -1, dtype=torch.long, device=x.device)
        cand_src = i == cfg.candidate_source_layer
        blocks = []
        if n_keys:
            keys = keys.to(x.device)
            visible = nx.compressed_visible(pos, ratio)
            kk = min(cfg.index_topk, n_keys)
            cand = (state.layers[cfg.candidate_source_layer].blocks[pos0]
                    if cfg.uses_candidates(i) else None)
            step = max(1, self.m.attn_budget // max(1, h * n_keys))
            for a in range(0, n, step):
                b = min(a + step, n)
                # V4's index_select (exact scores masked to visible entries, and their top-k)
                # on every layer, so a recorder or a selection toggle sees each indexer call;
                # a layer behind the candidate source then picks within its blocks instead
                s, picks = nx.index_select(q[a:b], keys, wts[a:b], visible[a:b], kk)
                if cand_src:
                    C = nx.index_candidates(s, pos[a:b], ratio, cfg.candidate_block_size,
                                            cfg.candidate_topk_blocks)
                    blocks.append(_to_blocks(C, cfg.candidate_block_size))
                if cand is None:
                    out[a:b, :kk] = picks
                else:
                    C = _from_blocks(cand[a:b].to(x.device), cfg.candidate_block_size, n_keys)
                    out[a:b, :kk] = nx.candidate_topk(s, C, visible[a:b], kk)
                    s = s.masked_fill(~C, float("-inf"))      # the scores the tap shows
            if t:
                t("attn.index.last_scores", s[-1:])
        if cand_src:
            state.layers[i].blocks[pos0] = (torch.cat(blocks, 0) if blocks else
                                            torch.zeros(n, 0, dtype=torch.bool, device=x.device))
        state.layers[i].topk[pos0] = out
        if t:
            t("attn.index.topk", out)
        return out


def _to_blocks(mask: torch.Tensor, block: int) -> torch.Tensor:
    """[c, n] position mask of whole blocks -> [c, ceil(n/block)] kept blocks (compact)."""
    c, n = mask.shape
    nb = -(-n // block)
    pad = torch.zeros(c, nb * block - n, dtype=torch.bool, device=mask.device)
    return torch.cat([mask, pad], 1).view(c, nb, block).any(-1)


def _from_blocks(blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Kept blocks [c, nb] -> position mask [c, n] (positions past the blocks: not kept)."""
    m = blocks.repeat_interleave(block, 1)[:, :n]
    if m.shape[1] < n:
        m = torch.cat([m, torch.zeros(m.shape[0], n - m.shape[1], dtype=torch.bool,
                                      device=m.device)], 1)
    return m
