"""The golden DeepSeek-V4.1 forward (docs/v41-architecture.md §5), with V4's public API.

`ModelV41` is V4's Model (reference_model/model.py) where the architectures differ:
`extend`, `check_tokens`, `prefill_logits` and `device_of` are inherited; `new_state`,
`embed`, `layer` and `head` are V4.1's. Tools drive it exactly like Model (the lockstep's
layer-major pass, chunked prefill, schedules, the chunked head), and
`reference_model.build_model` picks the class by the config.

What V4.1 adds, each step a seam kernel (v41/numerics.py):
  * lagged mHC: each site collapses with the previous site's pre-mix, which travels with
    the residual stream between layers (v41/stream.py), so the head needs no hc_head;
  * Engram on its layers, over a compressed n-gram history kept in the sequence state;
  * compressed KV and index keys owned by the KV-source layers and read by every later
    compressed layer of the same ratio; top-k computed on index sources and reused by the
    layers after them; candidate blocks from the candidate source restricting later
    index sources.

State between calls (doc §5.7) is explicit, as in V4, so decode = prefill and chunked =
one-shot hold bit for bit in the reference profile."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model import InputError, Model
from ..placement import place_layers
from ..schedule import ONESHOT, Schedule, Segment, in_step
from ..taps import Taps
from . import kernels as K
from . import stream
from .config import V41Config
from .engram import compressed_token_map, engram_layout
from .sizes import layer_row, spec_bytes
from .specs import global_specs
from .weights import EngramTable


class EngramVocabularyError(ValueError):
    """The compressed vocabulary the Engram hash runs over cannot be built or disagrees
    with the config (it would silently rehash every n-gram)."""


# ---- state ----------------------------------------------------------------------------------
@dataclass
class V41LayerState:
    """One layer's state. Every layer keeps its window; KV sources own the compressed cache,
    the open ratio-2 group and the index keys (read by the layers after them); index
    sources keep their top-k picks, and the candidate source its block mask, for the layers
    after them in the same call (keyed by the chunk's first position)."""
    window_kv: torch.Tensor | None = None          # last (window-1) KV rows, oldest first
    comp_kv: torch.Tensor | None = None            # KV source: compressed entries [n, head_dim]
    pending: tuple | None = None                   # KV source, ratio 2: (K, G) fp32 of the open group
    n_groups: int = 0                              # KV source: entries emitted so far
    index_keys: torch.Tensor | None = None         # KV source: index keys [n, index_head_dim]
    fresh: bool = False                            # KV source: emitted entries in the current chunk
    topk: dict = field(default_factory=dict)       # index source: chunk start -> picks [c, index_topk]
    blocks: dict = field(default_factory=dict)     # candidate source: chunk start -> kept blocks [c, nb]


@dataclass
class V41SequenceState:
    layers: list[V41LayerState]
    pos: int = 0                                   # tokens already processed
    engram_hist: torch.Tensor | None = None        # compressed id per absolute position (Engram)
    key_writer: int | None = None                  # KV source that emitted index keys last (D1)

    @classmethod
    def empty(cls, cfg: V41Config) -> "V41SequenceState":
        return cls([V41LayerState() for _ in range(cfg.n_layers)])


def _cat(a, b):
    return b if a is None else torch.cat([a, b], 0)


# ---- the compressed vocabulary ------------------------------------------------------------
def _tokenizer_path(weights):
    """A tokenizer.json next to the checkpoint the weights came from, if any."""
    root = getattr(getattr(weights, "info", None), "root", None)
    if root is not None and (root / "tokenizer.json").is_file():
        return root / "tokenizer.json"
    return None


def token_map_for(cfg: V41Config, weights=None, tokenizer=None) -> list[int]:
    """Token id -> compressed id (REF-E `build_compressed_token_map`) from, in order: the
    given tokenizer (path or `tokenizers.Tokenizer`), the checkpoint's tokenizer.json, or
    the shipped tiny tokenizer when its vocabulary is the model's. Its size must equal
    `engram_compressed_vocab_size`."""
    from tokenizers import Tokenizer

    from ..tokenizer import DEFAULT_PATH, VOCAB_SIZE
    src = tokenizer if tokenizer is not None else _tokenizer_path(weights)
    if src is None:
        if cfg.vocab_size != VOCAB_SIZE:
            raise EngramVocabularyError(
                f"Engram needs the tokenizer (its compressed vocabulary): none given and no "
                f"tokenizer.json next to the checkpoint (vocab_size {cfg.vocab_size})")
        src = DEFAULT_PATH
    tok = src if isinstance(src, Tokenizer) else Tokenizer.from_file(str(src))
    tmap, size = compressed_token_map(tok)
    if size != cfg.engram_compressed_vocab_size:
        raise EngramVocabularyError(f"compressed vocabulary of the tokenizer is {size}, config "
                                    f"engram_compressed_vocab_size is "
                                    f"{cfg.engram_compressed_vocab_size}: the hash would rehash")
    if len(tmap) < cfg.vocab_size:
        tmap = tmap + [0] * (cfg.vocab_size - len(tmap))         # ids the tokenizer lacks
    return tmap


# ---- the model -------------------------------------------------------------------------------
class ModelV41(Model):
    def __init__(self, weights, numerics=None, chunk_tokens: int = 2048,
                 attn_budget: int = 1 << 25, weight_cache: dict | None = None,
                 devices: list | None = None, schedule: Schedule = ONESHOT,
                 token_map=None, tokenizer=None):
        """V4's constructor arguments; `token_map` (token id -> compressed id) or
        `tokenizer` give Engram's compressed vocabulary (default: token_map_for)."""
        super().__init__(weights, numerics,
                         chunk_tokens=chunk_tokens, attn_budget=attn_budget,
                         weight_cache=weight_cache, devices=None, schedule=schedule)
        cfg = self.cfg
        if not isinstance(cfg, V41Config):
            raise TypeError(f"ModelV41 runs DeepSeek-V4.1 configs, got {type(cfg).__name__}; "
                            "use reference_model.build_model to pick the class")
        if cfg.gate_temp != 1.0:
            raise NotImplementedError(f"gate_temp {cfg.gate_temp}: the golden implements the "
                                      "released gate_temp 1.0 only")
        if devices:
            self.devices = [torch.device(d) for d in devices]
            self._owner = v41_placement(cfg, len(self.devices))
        self.layout = engram_layout(cfg) if cfg.engram_layer_ids else None
        self._token_map = None
        if self.layout is not None:
            tm = token_map if token_map is not None else token_map_for(cfg, weights, tokenizer)
            self._token_map = torch.as_tensor(tm, dtype=torch.long)
            self.pad_c = int(self._token_map[cfg.engram_pad_id])
        # the last layer that reads each index source's top-k / the candidate source's
        # blocks: after it has run, the per-call picks are dropped
        self._last_topk_reader = {}
        for i in range(cfg.n_layers):
            s = cfg.index_source(i)
            if s is not None:
                self._last_topk_reader[s] = i
        users = [i for i in range(cfg.n_layers) if cfg.uses_candidates(i)]
        self._last_block_reader = users[-1] if users else None

    # ---- weights --------------------------------------------------------------------------
    def _weights(self, i: int | None, head: bool = False) -> dict:
        """As V4's: resident layers converted once to the compute dtype and kept, streamed
        layers used as given; Engram tables stay in checkpoint form on the host (their
        `to` is a no-op; engram_lookup moves only the gathered rows to the layer's device)."""
        src = self.weights.global_weights() if i is None else self.weights.layer_weights(i)
        dev = self.device_of(i, head)
        if i is not None and not getattr(self.weights, "resident", False):
            if dev is None or getattr(src, "placed", False):
                return src
            return {k: v.to(dev) for k, v in src.items()}
        cd = self.nx.cd
        key = ("v41", i, cd) if dev is None else ("v41", i, cd, str(dev))
        if key not in self._wcache:
            def conv(k, v):
                if not isinstance(v, EngramTable) and v.is_floating_point() and k != "embed.weight":
                    v = v.to(cd)
                return v.to(dev) if dev is not None else v
            self._wcache[key] = {k: conv(k, v) for k, v in src.items()}
        return self._wcache[key]

    def _lin(self, x, w: dict, name: str):
        """An FP8 (32x32-block) Linear of the layer: V4.1's GEMM with 1x32 act quant."""
        return self.nx.fp8_linear32(x, self.nx.weight_dequant(w[name + ".weight"]))

    # ---- public API -----------------------------------------------------------------------
    def new_state(self) -> V41SequenceState:
        return V41SequenceState.empty(self.cfg)

    def embed(self, tokens, taps: Taps | None = None) -> torch.Tensor:
        """Embedding rows as the four streams, with P_0 = stream 0 (make_identity_pre_mix),
        packed into one stream tensor (v41/stream.py)."""
        emb = self.weights.global_weights()["embed.weight"]
        e = emb[tokens.to(emb.device)]
        if self.devices:
            e = e.to(self.devices[0])
        nx = self.nx
        H = nx.rs(e).to(nx.sd).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        if taps:
            taps.put("embed", H[:, 0])
        P = K.identity_pre_mix(H.shape[0], self.cfg.hc_mult, device=H.device)
        return stream.pack(H, P, nx.sd)

    def layer(self, i: int, S, tokens, state: V41SequenceState, taps: Taps | None = None,
              phase: str = "prefill") -> torch.Tensor:
        """Block i over the new tokens (positions state.pos ...); updates the state it owns
        (and reads the sources' state). S: the packed stream (embed / previous layer)."""
        w = self._weights(i)
        dev = self.device_of(i)
        if dev is not None:
            S, tokens = S.to(dev), tokens.to(dev)
        H, P = stream.unpack(S, self.cfg.dim)
        outH, outP, starts = [], [], []
        for seg in self._segments(H.shape[0], state, phase):
            if seg.restore:
                state.layers[i] = self.nx.state_restore(state.layers[i])
            for a in range(seg.start, seg.end, self.chunk_tokens):
                b = min(a + self.chunk_tokens, seg.end)
                if a > 0 and seg.phase == "prefill" and not (seg.restore and a == seg.start):
                    state.layers[i] = self.nx.chunk_boundary(state.layers[i])
                with in_step(self.schedule.batch * (b - a)):
                    h, p = self._block(i, w, H[a:b], P[a:b], tokens[a:b], state, state.pos + a,
                                       taps, seg.phase)
                starts.append(state.pos + a)
                outH.append(h.to(self.nx.sd))
                outP.append(p)
        self._drop_call_scratch(i, state, starts)
        H = torch.cat(outH, 0)
        if taps:
            taps.put(f"layers.{i}.out", H)
        return stream.pack(H, torch.cat(outP, 0), self.nx.sd)

    def _segments(self, n: int, state, phase: str) -> list[Segment]:
        if phase == "prefill" and state.pos == 0:
            return self.schedule.segments(n)
        return [Segment(0, n, phase)]

    def _drop_call_scratch(self, i: int, state: V41SequenceState, starts: list[int]) -> None:
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

    def head(self, S, taps: Taps | None = None) -> torch.Tensor:
        """norm(collapse(H, P_last)) then the fp32 head: no hc_head in V4.1 (doc §5.6)."""
        g = self._weights(None, head=True)
        if self.devices:
            S = S.to(self.devices[-1])
        cfg, nx = self.cfg, self.nx
        H, P = stream.unpack(S, cfg.dim)
        x = nx.rms_norm(nx.hc_pre_lagged(H, P, P), g["norm.weight"], cfg.norm_eps)
        if taps:
            taps.put("final_hidden", x)
        logits = nx.lm_head(x, g["head.weight"])
        if taps:
            taps.put("logits", logits)
        return logits

    # ---- block ------------------------------------------------------------------------------
    def _block(self, i, w, H, P, tokens, state: V41SequenceState, pos0: int, taps, phase):
        """Doc §5.3: Engram (on its layers), then attention collapsed with the previous
        site's pre-mix P, then the MoE collapsed with the attention's pre-mix; returns the
        streams and P for the next site (the FFN's pre-mix)."""
        cfg, nx = self.cfg, self.nx
        t = (lambda name, v: taps.put(f"layers.{i}.{name}", v)) if taps else None
        if i in cfg.engram_layer_ids:
            H = self._engram(i, w, H, tokens, state, pos0, t)
        pre_a, post_a, comb_a = nx.hc_mix(H, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg)
        if t:
            t("hc_attn.post", post_a), t("hc_attn.comb", comb_a)
        x = nx.rms_norm(nx.hc_pre_lagged(H, P, pre_a), w["attn_norm.weight"], cfg.norm_eps)
        a = self._attention(i, w, x, state, pos0, t, phase)
        if t:
            t("attn.out", a)
        H = nx.hc_post(a, H, post_a, comb_a)
        pre_f, post_f, comb_f = nx.hc_mix(H, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg)
        if t:
            t("hc_ffn.post", post_f), t("hc_ffn.comb", comb_f)
        x = nx.rms_norm(nx.hc_pre_lagged(H, pre_a, pre_f), w["ffn_norm.weight"], cfg.norm_eps)
        f = self._moe(i, w, x, tokens, t)
        if t:
            t("ffn.out", f)
        return nx.hc_post(f, H, post_f, comb_f), pre_f

    # ---- Engram -------------------------------------------------------------------------------
    def _history(self, tokens, state: V41SequenceState, pos0: int) -> torch.Tensor:
        """The compressed history covering positions 0 .. pos0+n-1: the first Engram layer
        to see a chunk appends its tokens (all text: no DEAD image spans)."""
        n = tokens.shape[0]
        have = 0 if state.engram_hist is None else state.engram_hist.shape[0]
        if have < pos0:
            raise InputError(f"Engram history covers {have} positions, the chunk starts at {pos0}")
        if have < pos0 + n:
            new = K.compress_history(tokens[have - pos0:], self._token_map.to(tokens.device))
            state.engram_hist = _cat(state.engram_hist, new)
        return state.engram_hist

    def _engram(self, i, w, H, tokens, state, pos0, t):
        cfg, nx = self.cfg, self.nx
        hist = self._history(tokens, state, pos0)
        pos = torch.arange(pos0, pos0 + H.shape[0], device=H.device)
        k = cfg.engram_layer_ids.index(i)
        ids = nx.engram_hash(hist.to(H.device), pos, self.layout, self.pad_c)[:, k]
        if t:
            t("engram.ids", ids)
        rows = nx.engram_lookup(w["engram.embed.weight"], ids)
        kv = self._lin(rows.flatten(1), w, "engram.wkv")
        H = nx.engram_gate(H, kv, w["engram.q_weight"], w["engram.k_weight"], cfg.norm_eps)
        if t:
            t("engram.out", H)
        return H

    # ---- attention ----------------------------------------------------------------------------
    def _attention(self, i, w, x, state: V41SequenceState, pos0, t, phase):
        cfg, nx = self.cfg, self.nx
        st = state.layers[i]
        n = x.shape[0]
        ratio = cfg.compress_ratios[i]
        pos = torch.arange(pos0, pos0 + n, device=x.device)
        inv = self._inv_freq(ratio, x.device if self.devices else None)

        def rope(v, site, p=pos, inverse=False):
            return nx.rope_apply(v, inv, p, site, inverse, phase)

        qr = nx.rms_norm(self._lin(x, w, "attn.wq_a"), w["attn.q_norm.weight"], cfg.norm_eps)
        q = self._lin(qr, w, "attn.wq_b").view(n, cfg.n_heads, cfg.head_dim)
        q = rope(nx.q_head_norm(q, cfg.norm_eps), "q")
        kv = nx.rms_norm(self._lin(x, w, "attn.wkv"), w["attn.kv_norm.weight"], cfg.norm_eps)
        kv = nx.window_kv_store(rope(kv, "kv"))
        if t:
            t("attn.q", q), t("attn.kv", kv)

        comp, topk = None, None
        if ratio:
            src = cfg.kv_source(i)
            if i == src:
                self._compress(i, w, x, state, pos0, inv, t, phase)
            if i in cfg.index_source_layers:
                topk = self._indexer(i, w, x, qr, state, pos, rope, t, phase)
            else:
                topk = state.layers[cfg.index_source(i)].topk[pos0]
            comp = state.layers[src].comp_kv

        prev = st.window_kv
        n_prev = 0 if prev is None else prev.shape[0]
        allw = kv if prev is None else torch.cat([prev, kv], 0)
        rows = allw
        n_comp = 0 if comp is None else comp.shape[0]
        if n_comp:
            rows = torch.cat([rows, comp.to(x.device)], 0)
        idx = self._attn_indices(pos, pos0, n_prev, n_prev + n, topk)
        o = torch.empty_like(q)
        step = max(1, self.attn_budget // max(1, idx.shape[1] * cfg.head_dim))
        scale = cfg.head_dim ** -0.5
        for a in range(0, n, step):
            o[a:a + step] = nx.sparse_attention(q[a:a + step], rows, w["attn.attn_sink"],
                                                idx[a:a + step], scale, phase)
        o = rope(o, "output", inverse=True)
        keep = cfg.window_size - 1
        st.window_kv = allw[-keep:].clone() if keep > 0 else allw[:0]

        g = cfg.o_groups
        wo_a = nx.weight_dequant(w["attn.wo_a.weight"]).view(g, cfg.o_lora_rank, -1)
        u = nx.wo_a(o.reshape(n, g, -1), wo_a)
        return self._lin(u.reshape(n, -1), w, "attn.wo_b")

    def _attn_indices(self, pos, pos0, n_prev, comp_off, topk):
        """Row indices into [window rows | new rows | compressed rows] per query (-1 =
        empty): the window t-W+1..t, then the top-k picks of the compressed cache."""
        W = self.cfg.window_size
        off = torch.arange(-(W - 1), 1, device=pos.device)
        wpos = pos.unsqueeze(1) + off
        first = self.nx.window_first(pos, W).unsqueeze(1)
        widx = wpos - (pos0 - n_prev)
        ok = (wpos >= first) & (wpos >= 0) & (widx >= 0)
        widx = torch.where(ok, widx, torch.full_like(widx, -1))
        if topk is None:
            return widx
        topk = topk.to(pos.device)
        return torch.cat([widx, torch.where(topk >= 0, topk + comp_off, topk)], 1)

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
        st.comp_kv = _cat(st.comp_kv, entries)
        st.index_keys = _cat(st.index_keys, k)
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
        q = self._lin(qr, w, "attn.indexer.wq_b").view(n, h, d)
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
            cols = torch.arange(n_keys, device=x.device)
            cand = (state.layers[cfg.candidate_source_layer].blocks[pos0]
                    if cfg.uses_candidates(i) else None)
            step = max(1, self.attn_budget // max(1, h * n_keys))
            for a in range(0, n, step):
                b = min(a + step, n)
                s = nx.index_scores(q[a:b], keys, wts[a:b])
                s = s.masked_fill(cols.unsqueeze(0) >= visible[a:b].unsqueeze(1), float("-inf"))
                if cand_src:
                    C = nx.index_candidates(s, pos[a:b], ratio, cfg.candidate_block_size,
                                            cfg.candidate_topk_blocks)
                    blocks.append(_to_blocks(C, cfg.candidate_block_size))
                if cand is None:
                    out[a:b, :kk] = nx.index_topk(s, kk)
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

    # ---- MoE ----------------------------------------------------------------------------------
    def _moe(self, i, w, x, tokens, t):
        """sqrtsoftplus router with `bias` for selection only (text tokens: never bias_vl),
        weights renormalised ×route_scale; routed FP4 experts and the FP8 shared expert, both
        with V4.1's 1x32 act quant. (REF divides by sum + 1e-20: identical to the V4 kernel's
        plain sum for any sum above ~1e-4, which sqrtsoftplus top-k sums always are.)"""
        cfg, nx = self.cfg, self.nx
        scores = nx.moe_gate(x, w["ffn.gate.weight"], cfg.score_func)
        bias = w["ffn.gate.bias"]
        idx = nx.moe_select(scores, bias, tokens, None, cfg.n_activated_experts, i, False)
        weights = nx.route_weights(scores, idx, bias, cfg.route_scale, renormalize=True)
        if t:
            t("ffn.router.experts", idx), t("ffn.router.weights", weights)
        y = torch.zeros(x.shape[0], cfg.dim, dtype=nx.cd, device=x.device)
        for e in range(cfg.n_routed_experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            p = f"ffn.experts.{e}."
            y = y.index_add(0, tok, nx.expert_ffn32(x[tok], w[p + "w1.weight"], w[p + "w3.weight"],
                                                    w[p + "w2.weight"], weights[tok, slot],
                                                    cfg.swiglu_limit))
        shared = None
        if cfg.n_shared_experts:
            p = "ffn.shared_experts."
            dq = nx.weight_dequant
            shared = nx.expert_ffn32(x, dq(w[p + "w1.weight"]), dq(w[p + "w3.weight"]),
                                     dq(w[p + "w2.weight"]), None, cfg.swiglu_limit)
        return nx.moe_combine(y, shared)


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


def v41_placement(cfg: V41Config, n_devices: int) -> list[int]:
    """Each layer's device: contiguous ranges balanced on in-memory weight bytes (V4's rule,
    V4.1's tensor table; Engram tables stay on the host, so they do not count)."""
    lb = [layer_row(cfg, i)["bf16"] for i in range(cfg.n_layers)]
    first = sum(spec_bytes(s, "bf16") for s in global_specs(cfg) if s.name.startswith("embed"))
    last = sum(spec_bytes(s, "bf16") for s in global_specs(cfg)) - first
    owner = [0] * cfg.n_layers
    for k, r in enumerate(place_layers(lb, n_devices, first, last)):
        for i in r:
            owner[i] = k
    return owner


__all__ = ["EngramVocabularyError", "ModelV41", "V41LayerState", "V41SequenceState",
           "token_map_for", "v41_placement"]
