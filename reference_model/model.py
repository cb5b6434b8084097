"""The golden DeepSeek-V4 forward (research §5), one sequence at a time, layer by layer.

`Model.extend(tokens, state)` runs any number of new tokens on top of `state` (prefill
from empty, chunked prefill, or a one-token decode step): the same code path, so decode
equals prefill by construction of the state, not by a second implementation. Memory is
linear in context: queries are processed in chunks and attention only ever gathers the
window plus the selected (CSA) or visible (HCA) compressed rows.

Layer-major API for lockstep runners: `embed`, then `layer(i, ...)`, then `head`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .placement import model_placement
from .schedule import ONESHOT, Schedule, Segment, in_step
from .numerics import Numerics
from .taps import Taps
from .weights import WeightSource


class InputError(ValueError):
    """Bad tokens or prompt length."""


# ---- per-layer state ------------------------------------------------------------------
@dataclass
class CompressorState:
    """Partial-window state of a compressor: rows of the unfinished group (score already
    has `ape` added) and, for the overlapping ratio-4 compressor, the last complete group."""
    pending_kv: torch.Tensor | None = None
    pending_score: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    n_groups: int = 0


@dataclass
class LayerState:
    window_kv: torch.Tensor | None = None          # last (window-1) KV rows, oldest first
    comp_kv: torch.Tensor | None = None            # compressed entries [n, head_dim]
    comp: CompressorState = field(default_factory=CompressorState)
    index_keys: torch.Tensor | None = None         # indexer keys [n, index_head_dim]
    index_comp: CompressorState = field(default_factory=CompressorState)


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0                                   # tokens already processed

    @classmethod
    def empty(cls, cfg: ModelConfig) -> "SequenceState":
        return cls([LayerState() for _ in range(cfg.n_layers)])


def _cat(a, b):
    return b if a is None else torch.cat([a, b], 0)


class Model:
    def __init__(self, weights: WeightSource, numerics: Numerics | None = None,
                 chunk_tokens: int = 2048, attn_budget: int = 1 << 25,
                 weight_cache: dict | None = None, devices: list | None = None,
                 schedule: Schedule = ONESHOT):
        self.cfg = weights.cfg
        self.schedule = schedule                   # how a prompt is fed (reference_model.schedule)
        self.weights = weights
        self.nx = numerics or Numerics("reference")
        self.chunk_tokens = chunk_tokens           # tokens per layer pass (chunked prefill)
        self.attn_budget = attn_budget             # max elements gathered per attention step
        self._inv_cache: dict = {}
        # resident weights, converted once; models of several arms over one checkpoint may
        # share it (keyed by compute dtype, so arms with another dtype get their own copy)
        self._wcache: dict = {} if weight_cache is None else weight_cache
        # pipeline placement: layers split contiguously over the devices, the embedding on
        # the first, the head on the last; activations move between them (None: as given)
        self.devices = [torch.device(d) for d in devices] if devices else None
        self._owner = model_placement(self.cfg, len(self.devices)) if devices else None

    def device_of(self, i: int | None, head: bool = False) -> torch.device | None:
        """Where layer i runs (None = the globals: embedding on the first device, head on
        the last); None without a placement."""
        if self.devices is None:
            return None
        if i is None:
            return self.devices[-1 if head else 0]
        return self.devices[self._owner[i]]

    def _weights(self, i: int | None, head: bool = False) -> dict:
        """Layer i's weights (None = globals) in the compute dtype, on the layer's device.
        Globals and resident (in-memory) layers are converted once and kept; streamed layers
        are converted per use, so a streamed checkpoint still holds one layer at a time."""
        src = self.weights.global_weights() if i is None else self.weights.layer_weights(i)
        dev = self.device_of(i, head)
        if i is not None and not getattr(self.weights, "resident", False):
            if dev is None or getattr(src, "placed", False):    # already on the layer's device
                return src
            return {k: v.to(dev) for k, v in src.items()}
        cd = self.nx.cd
        key = (i, cd) if dev is None else (i, cd, str(dev))
        if key not in self._wcache:
            self._wcache[key] = {k: (v.to(cd) if v.is_floating_point() and k != "embed.weight" else v)
                                 .to(dev if dev is not None else v.device)
                                 for k, v in src.items()}          # embed: rows are gathered
        return self._wcache[key]

    # ---- public API ---------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.cfg)

    def check_tokens(self, tokens: torch.Tensor, state: SequenceState) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1:
            raise InputError(f"tokens must be a 1-D sequence of ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise InputError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.numel() == 0:
            raise InputError("empty token sequence")
        bad = (tokens < 0) | (tokens >= self.cfg.vocab_size)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise InputError(f"token id {int(tokens[i])} at index {i} is out of range "
                             f"[0, vocab_size={self.cfg.vocab_size})")
        end = state.pos + tokens.numel()
        if end > self.cfg.max_seq_len:
            raise InputError(f"sequence of {end} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        return tokens.long()

    def extend(self, tokens, state: SequenceState | None = None, logits: str = "last",
               taps: Taps | None = None, phase: str | None = None):
        """Run new tokens; returns (logits, state). logits: 'last', 'all', 'none', or
        'hidden' (the residual streams the head would read, so a caller can run the head a
        chunk of positions at a time and never hold [tokens, vocab] logits)."""
        state = state or self.new_state()
        tokens = self.check_tokens(tokens, state)
        if phase is None:
            phase = "decode" if state.pos > 0 and tokens.numel() == 1 else "prefill"
        H = self.embed(tokens, taps)
        for i in range(self.cfg.n_layers):
            H = self.layer(i, H, tokens, state, taps, phase)
        out = None
        if logits == "hidden":
            out = H
        elif logits != "none":
            out = self.head(H if logits == "all" else H[-1:], taps)
        state.pos += tokens.numel()
        return out, state

    def prefill_logits(self, tokens, taps: Taps | None = None) -> torch.Tensor:
        """Logits for every position of a prompt, from an empty state."""
        return self.extend(tokens, None, "all", taps)[0]

    # ---- layer-major pieces -------------------------------------------------------------
    def embed(self, tokens, taps: Taps | None = None) -> torch.Tensor:
        emb = self.weights.global_weights()["embed.weight"]
        e = emb[tokens.to(emb.device)]                                  # rows only: no conversion
        if self.devices:
            e = e.to(self.devices[0])
        H = self.nx.rs(e).to(self.nx.sd).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        if taps:
            taps.put("embed", H[:, 0])
        return H

    def layer(self, i: int, H, tokens, state: SequenceState, taps: Taps | None = None,
              phase: str = "prefill") -> torch.Tensor:
        """Block i over the new tokens (positions state.pos ...); updates state.layers[i]."""
        w = self._weights(i)
        dev = self.device_of(i)
        if dev is not None:                              # the activations follow the layer
            H, tokens = H.to(dev), tokens.to(dev)
        out = []
        for seg in self._segments(H.shape[0], state, phase):
            if seg.restore:                              # a cache hit: saved, then restored
                state.layers[i] = self.nx.state_restore(state.layers[i])
            for a in range(seg.start, seg.end, self.chunk_tokens):
                b = min(a + self.chunk_tokens, seg.end)
                if a > 0 and seg.phase == "prefill" and not (seg.restore and a == seg.start):
                    state.layers[i] = self.nx.chunk_boundary(state.layers[i])
                # the stream is stored in the storage dtype between layers (bf16 in the
                # reference, lossless: hc_post already rounded it), halving memory at long context
                with in_step(self.schedule.batch * (b - a)):
                    out.append(self._block(i, w, H[a:b], tokens[a:b], state.layers[i], state.pos + a,
                                           taps, seg.phase).to(self.nx.sd))
        H = torch.cat(out, 0)
        if taps:
            taps.put(f"layers.{i}.out", H)
        return H

    def _segments(self, n: int, state: SequenceState, phase: str) -> list[Segment]:
        """The schedule's pieces for a prompt from an empty state; otherwise one piece."""
        if phase == "prefill" and state.pos == 0:
            return self.schedule.segments(n)
        return [Segment(0, n, phase)]

    def head(self, H, taps: Taps | None = None) -> torch.Tensor:
        g = self._weights(None, head=True)
        if self.devices:
            H = H.to(self.devices[-1])
        cfg, nx = self.cfg, self.nx
        x = nx.hc_head(H, g["hc_head_fn"], g["hc_head_scale"], g["hc_head_base"], cfg)
        x = nx.rms_norm(x, g["norm.weight"], cfg.norm_eps)
        if taps:
            taps.put("final_hidden", x)
        logits = nx.lm_head(x, g["head.weight"])
        if taps:
            taps.put("logits", logits)
        return logits

    # ---- block ----------------------------------------------------------------------------
    def _block(self, i, w, H, tokens, st: LayerState, pos0: int, taps, phase):
        cfg, nx = self.cfg, self.nx
        t = (lambda name, v: taps.put(f"layers.{i}.{name}", v)) if taps else None
        x, post, comb = nx.hc_pre(H, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg)
        if t:
            t("hc_attn.post", post), t("hc_attn.comb", comb)
        x = nx.rms_norm(x, w["attn_norm.weight"], cfg.norm_eps)
        a = self._attention(i, w, x, st, pos0, t, phase)
        if t:
            t("attn.out", a)
        H = nx.hc_post(a, H, post, comb)
        if "hc_post" not in nx.replaced:
            # the golden hc_post returns storage-dtype values: held as such (lossless, as
            # between layers) they cost the FFN's hc_pre/hc_post a quarter of the reads
            H = H.to(nx.sd)
        x, post, comb = nx.hc_pre(H, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg)
        if t:
            t("hc_ffn.post", post), t("hc_ffn.comb", comb)
        x = nx.rms_norm(x, w["ffn_norm.weight"], cfg.norm_eps)
        f = self._moe(i, w, x, tokens, t)
        if t:
            t("ffn.out", f)
        return nx.hc_post(f, H, post, comb)

    # ---- attention ------------------------------------------------------------------------
    def _inv_freq(self, ratio: int, device=None) -> torch.Tensor:
        """The layer type's RoPE frequencies (window-only vs compressed), computed once
        (per device under a placement)."""
        key = (ratio != 0, None if device is None else str(device))
        if key not in self._inv_cache:
            inv = self.nx.rope_inv_freq(self.cfg, ratio)
            self._inv_cache[key] = inv if device is None else inv.to(device)
        return self._inv_cache[key]

    def _attention(self, i, w, x, st: LayerState, pos0, t, phase):
        cfg, nx = self.cfg, self.nx
        n = x.shape[0]
        ratio = cfg.compress_ratios[i]
        pos = torch.arange(pos0, pos0 + n, device=x.device)
        inv = self._inv_freq(ratio, x.device if self.devices else None)

        def rope(v, site, inverse=False):
            return nx.rope_apply(v, inv, pos, site, inverse, phase)

        qr = nx.rms_norm(nx.fp8_linear(x, w["attn.wq_a.weight"]), w["attn.q_norm.weight"], cfg.norm_eps)
        q = nx.fp8_linear(qr, w["attn.wq_b.weight"]).view(n, cfg.n_heads, cfg.head_dim)
        q = rope(nx.q_head_rescale(q, cfg.norm_eps), "q")

        kvn = nx.rms_norm(nx.fp8_linear(x, w["attn.wkv.weight"]), w["attn.kv_norm.weight"],
                          cfg.norm_eps, round_out=False)
        nope = cfg.nope_head_dim
        kv = torch.cat([nx.kv_store(kvn[:, :nope]), rope(nx.rs(kvn[:, nope:]), "kv")], -1)
        if t:
            t("attn.q", q), t("attn.kv", kv)

        topk = None
        if ratio:
            new = self._compress(x, w, "attn.compressor.", ratio, cfg.head_dim, st.comp, pos0,
                                 kind="kv", phase=phase)
            st.comp_kv = _cat(st.comp_kv, new) if new.shape[0] else (
                st.comp_kv if st.comp_kv is not None else new)
            if t and new.shape[0]:
                t("attn.compressed_kv", new)
        if ratio == 4:
            topk = self._indexer(w, x, qr, st, pos, rope, t, phase)

        prev = st.window_kv
        n_prev = 0 if prev is None else prev.shape[0]
        n_comp = 0 if st.comp_kv is None else st.comp_kv.shape[0]
        rows = torch.cat([t for t in (prev, kv, st.comp_kv if n_comp else None) if t is not None], 0)
        comp_off = n_prev + n
        idx = self._attn_indices(pos, pos0, n_prev, comp_off, ratio, topk, n_comp)
        step = max(1, self.attn_budget // max(1, idx.shape[1] * cfg.head_dim))
        scale = cfg.head_dim ** -0.5
        parts = [nx.sparse_attention(q[a:a + step], rows, w["attn.attn_sink"], idx[a:a + step],
                                     scale, phase) for a in range(0, n, step)]
        o = parts[0].to(q.dtype) if len(parts) == 1 else torch.cat([p.to(q.dtype) for p in parts])
        o = rope(o, "output", inverse=True)
        # keep the last window-1 rows for the next chunk / decode step
        keep = cfg.window_size - 1
        allw = rows[:n_prev + n]                                       # [window rows | new rows]
        st.window_kv = allw[-keep:].clone() if keep > 0 else allw[:0].clone()

        g = cfg.o_groups
        wo_a = w["attn.wo_a.weight"].view(g, cfg.o_lora_rank, -1)
        u = nx.wo_a(o.reshape(n, g, -1), wo_a)
        return nx.fp8_linear(u.reshape(n, -1), w["attn.wo_b.weight"])

    def _attn_indices(self, pos, pos0, n_prev, comp_off, ratio, topk, n_comp):
        """Row indices into [window rows | new rows | compressed rows] for each query;
        -1 = empty. Window: positions t-W+1..t. CSA: the indexer's picks; HCA: all
        compressed entries j < (t+1)//ratio."""
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
        if ratio == 4 and topk is not None:
            parts.append(torch.where(topk >= 0, topk + comp_off, topk))
        elif ratio and n_comp:
            j = torch.arange(n_comp, device=dev).unsqueeze(0)
            vis = j < self.nx.compressed_visible(pos, ratio).unsqueeze(1)
            parts.append(torch.where(vis, j + comp_off, torch.full_like(j, -1)).expand(len(pos), -1))
        return torch.cat(parts, 1)

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
        kv, score = _cat(cs.pending_kv, kv), _cat(cs.pending_score, score)
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
        inv = self._inv_freq(ratio, x.device if self.devices else None)
        r = cfg.rope_head_dim
        if kind == "kv":
            return torch.cat([nx.kv_store(normed[:, :-r]),
                              nx.rope_apply(nx.rs(normed[:, -r:]), inv, first, "compressed_kv",
                                            phase=phase)], -1)
        k = nx.rope_apply(nx.rs(normed), inv, first, "index_k", phase=phase)
        return nx.index_key_store(k)

    # ---- lightning indexer ----------------------------------------------------------------
    def _indexer(self, w, x, qr, st: LayerState, pos, rope, t, phase):
        cfg, nx = self.cfg, self.nx
        n = x.shape[0]
        pos0 = int(pos[0])
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = nx.fp8_linear(qr, w["attn.indexer.wq_b.weight"]).view(n, h, d)
        q = nx.index_query(rope(q, "index_q"))
        new = self._compress(x, w, "attn.indexer.compressor.", 4, d, st.index_comp, pos0,
                             kind="index", phase=phase)
        if new.shape[0]:
            st.index_keys = _cat(st.index_keys, new)
        wts = nx.bf16_linear(x, w["attn.indexer.weights_proj.weight"])
        wts = nx.index_weights(wts, d ** -0.5 * h ** -0.5)
        keys = st.index_keys
        n_keys = 0 if keys is None else keys.shape[0]
        # fixed width index_topk (-1 padded) so picks of different chunks line up
        out = torch.full((n, cfg.index_topk), -1, dtype=torch.long, device=x.device)
        if n_keys == 0:
            return out
        visible = nx.compressed_visible(pos, 4)
        k = min(cfg.index_topk, n_keys)
        step = max(1, self.attn_budget // max(1, h * n_keys))
        for a in range(0, n, step):
            b = min(a + step, n)
            s = nx.index_scores(q[a:b], keys, wts[a:b])
            cols = torch.arange(n_keys, device=x.device)
            s = s.masked_fill(cols.unsqueeze(0) >= visible[a:b].unsqueeze(1), float("-inf"))
            out[a:b, :k] = nx.index_topk(s, k)
        if t:
            t("attn.index.topk", out)
            # the chunk's last query's scores over every key (-inf: not visible): at the
            # prompt's end, how close each entry sits to the top-k boundary (selection margins)
            t("attn.index.last_scores", s[-1:])
        return out

    # ---- MoE ------------------------------------------------------------------------------
    def _moe(self, i, w, x, tokens, t):
        cfg, nx = self.cfg, self.nx
        scores = nx.moe_gate(x, w["ffn.gate.weight"], cfg.score_func)
        hashed = cfg.is_hash_layer(i)
        bias = None if hashed else w["ffn.gate.bias"]
        idx = nx.moe_select(scores, bias, tokens, w.get("ffn.gate.tid2eid"),
                            cfg.n_activated_experts, i, hashed)
        weights = nx.route_weights(scores, idx, bias, cfg.route_scale,
                                   renormalize=cfg.score_func != "softmax")
        if t:
            t("ffn.router.experts", idx), t("ffn.router.weights", weights)
        return moe_experts(nx, cfg, w, x, idx, weights)


def moe_experts(nx: Numerics, cfg: ModelConfig, w: dict, x, idx, weights):
    """Routed experts summed in fp32 in expert-index order (out-of-place, so autograd can
    train through it), plus the shared expert, combined. idx/weights [n, top-k]."""
    y = torch.zeros(x.shape[0], cfg.dim, dtype=nx.cd, device=x.device)
    for e in range(cfg.n_routed_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        p = f"ffn.experts.{e}."
        out = nx.expert_ffn(x[tok], w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"],
                            weights[tok, slot], cfg.swiglu_limit)
        # in place when autograd is not recording (inference): the same sums, no copy of y
        grad = torch.is_grad_enabled() and (y.requires_grad or out.requires_grad)
        y = y.index_add(0, tok, out) if grad else y.index_add_(0, tok, out)
    shared = None
    if cfg.n_shared_experts:
        p = "ffn.shared_experts."
        shared = nx.expert_ffn(x, w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"],
                               None, cfg.swiglu_limit)
    return nx.moe_combine(y, shared)
