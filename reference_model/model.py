"""The golden DeepSeek-V4 / V4.1 forward (docs/research/dsv4-architecture.md §5; docs/v41-architecture.md §5), one
sequence at a time, layer by layer. One model for both versions: the pieces that differ
(mHC lag, attention sources, Engram, GEMM grids, placement) are parts picked by the config
(reference_model/version.py).

`Model.extend(tokens, state)` runs any number of new tokens on top of `state` (prefill
from empty, chunked prefill, or a one-token decode step): the same code path, so decode
equals prefill by construction of the state, not by a second implementation. Memory is
linear in context: queries are processed in chunks and attention only ever gathers the
window plus the selected or visible compressed rows.

Layer-major API for lockstep runners: `embed`, then `layer(i, ...)`, then `head`; `block`
is one layer's computation on explicit weights (an MTP stage reuses it and `head`)."""
from __future__ import annotations

import copy

import torch

from .errors import InputError
from .heap import keep_freed_memory
from .moe import moe, moe_experts
from .numerics import Numerics
from .schedule import ONESHOT, Schedule, Segment, in_step
from .state import CompressorState, LayerState, SequenceState
from .taps import Taps
from .version import parts_for
from .weights import WeightSource


class Model:
    def __init__(self, weights: WeightSource, numerics: Numerics | None = None,
                 chunk_tokens: int = 2048, attn_budget: int = 1 << 25,
                 weight_cache: dict | None = None, devices: list | None = None,
                 schedule: Schedule = ONESHOT, token_map=None, tokenizer=None):
        """`token_map` (token id -> compressed id) or `tokenizer` give V4.1 Engram's
        compressed vocabulary (default: v41.engram_step.token_map_for)."""
        self.cfg = weights.cfg
        if not devices or all(torch.device(d).type == "cpu" for d in devices):
            keep_freed_memory()                    # no page faults on each large temporary
        self.schedule = schedule                   # how a prompt is fed (reference_model.schedule)
        self.weights = weights
        self.nx = numerics or Numerics("reference")
        self.chunk_tokens = chunk_tokens           # tokens per layer pass (chunked prefill)
        self.attn_budget = attn_budget             # max elements gathered per attention step
        self._inv_cache: dict = {}
        # resident weights, converted once; models of several arms over one checkpoint may
        # share it (keyed by compute dtype, so arms with another dtype get their own copy)
        self._wcache: dict = {} if weight_cache is None else weight_cache
        self.parts = parts_for(self.cfg)
        if getattr(self.cfg, "gate_temp", 1.0) != 1.0:
            raise NotImplementedError(f"gate_temp {self.cfg.gate_temp}: the golden implements the "
                                      "released gate_temp 1.0 only")
        # pipeline placement: layers split contiguously over the devices, the embedding on
        # the first, the head on the last; activations move between them (None: as given)
        self.devices = [torch.device(d) for d in devices] if devices else None
        self._owner = self.parts.placement(self.cfg, len(self.devices)) if devices else None
        self.mhc = self.parts.mhc(self)
        self.gemm = self.parts.gemm(self)
        self.attention = self.parts.attention(self)
        self.engram = (self.parts.engram(self, token_map, tokenizer)
                       if self.parts.engram and getattr(self.cfg, "engram_layer_ids", ()) else None)

    def with_numerics(self, nx: Numerics) -> "Model":
        """The same model (weights and their cache, placement, schedule) computing with `nx`:
        a shallow copy whose version parts (ModelPart: they read `.m.nx`) belong to the copy."""
        m = copy.copy(self)
        m.nx = nx
        for name in ("mhc", "gemm", "attention", "engram"):
            part = getattr(self, name)
            if hasattr(part, "m"):
                part = copy.copy(part)
                part.m = m
                setattr(m, name, part)
        return m

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
        are converted per use, so a streamed checkpoint still holds one layer at a time.
        Anything not a tensor (V4.1's Engram tables) stays as it is, on the host."""
        src = self.weights.global_weights() if i is None else self.weights.layer_weights(i)
        dev = self.device_of(i, head)
        if i is not None and not getattr(self.weights, "resident", False):
            if dev is None or getattr(src, "placed", False):    # already on the layer's device
                return src
            return {k: v.to(dev) for k, v in src.items()}
        cd = self.nx.cd
        key = (i, cd) if dev is None else (i, cd, str(dev))
        if key not in self._wcache:
            def conv(k, v):                                     # embed: rows are gathered
                if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "embed.weight":
                    v = v.to(cd)
                return v.to(dev) if dev is not None else v
            self._wcache[key] = {k: conv(k, v) for k, v in src.items()}
        return self._wcache[key]

    # ---- public API ---------------------------------------------------------------------
    def new_state(self):
        return self.attention.new_state()

    def check_tokens(self, tokens: torch.Tensor, state) -> torch.Tensor:
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

    def extend(self, tokens, state=None, logits: str = "last", taps: Taps | None = None,
               phase: str | None = None):
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
        """The embedding rows as the hc_mult streams (V4.1: with the lagged pre-mix packed
        in, v41/stream.py)."""
        emb = self.weights.global_weights()["embed.weight"]
        e = emb[tokens.to(emb.device)]                                  # rows only: no conversion
        if self.devices:
            e = e.to(self.devices[0])
        H = self.nx.rs(e).to(self.nx.sd).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        if taps:
            taps.put("embed", H[:, 0])
        return self.mhc.stream_in(H)

    def layer(self, i: int, S, tokens, state, taps: Taps | None = None,
              phase: str = "prefill") -> torch.Tensor:
        """Block i over the new tokens (positions state.pos ...); updates the layer state it
        owns (V4.1: and reads the sources'). S: the stream from embed / the previous layer."""
        w = self._weights(i)
        dev = self.device_of(i)
        if dev is not None:                              # the activations follow the layer
            S, tokens = S.to(dev), tokens.to(dev)
        H, P = self.mhc.unpack(S)
        outH, outP, starts = [], [], []
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
                    h, p = self.block(i, w, H[a:b], None if P is None else P[a:b], tokens[a:b],
                                      state, state.pos + a, taps, seg.phase)
                starts.append(state.pos + a)
                outH.append(h.to(self.nx.sd))
                outP.append(p)
        self.attention.after_layer(i, state, starts)
        H = torch.cat(outH, 0)
        if taps:
            taps.put(f"layers.{i}.out", H)
        return self.mhc.pack(H, outP)

    def _segments(self, n: int, state, phase: str) -> list[Segment]:
        """The schedule's pieces for a prompt from an empty state; otherwise one piece."""
        if phase == "prefill" and state.pos == 0:
            return self.schedule.segments(n)
        return [Segment(0, n, phase)]

    def head(self, S, taps: Taps | None = None, g: dict | None = None) -> torch.Tensor:
        """Final collapse of the stream, norm, fp32 logits. `g`: the head's weights (default
        the model's globals; an MTP stage passes its own hc_head / norm / head)."""
        g = g if g is not None else self._weights(None, head=True)
        if self.devices:
            S = S.to(self.devices[-1])
        cfg, nx = self.cfg, self.nx
        x = nx.rms_norm(self.mhc.head(S, g), g["norm.weight"], cfg.norm_eps)
        if taps:
            taps.put("final_hidden", x)
        logits = nx.lm_head(x, g["head.weight"])
        if taps:
            taps.put("logits", logits)
        return logits

    # ---- block ----------------------------------------------------------------------------
    def block(self, i, w, H, P, tokens, state, pos0: int, taps, phase):
        """Layer i on streams H (and the lagged pre-mix P; None in V4) with weights `w`:
        Engram (V4.1, on its layers), attention, MoE, each behind an mHC site. Returns the
        streams and the P for the next site."""
        cfg, nx = self.cfg, self.nx
        t = (lambda name, v: taps.put(f"layers.{i}.{name}", v)) if taps else None
        if self.engram is not None and i in cfg.engram_layer_ids:
            H = self.engram(i, w, H, tokens, state, pos0, t)
        x, post, comb, P = self.mhc.site(H, P, w, "attn")
        if t:
            t("hc_attn.post", post), t("hc_attn.comb", comb)
        x = nx.rms_norm(x, w["attn_norm.weight"], cfg.norm_eps)
        a = self.attention(i, w, x, state, pos0, t, phase)
        if t:
            t("attn.out", a)
        H = self.mhc.after_attention(nx.hc_post(a, H, post, comb))
        x, post, comb, P = self.mhc.site(H, P, w, "ffn")
        if t:
            t("hc_ffn.post", post), t("hc_ffn.comb", comb)
        x = nx.rms_norm(x, w["ffn_norm.weight"], cfg.norm_eps)
        f = moe(nx, cfg, self.gemm, i, w, x, tokens, t)
        if t:
            t("ffn.out", f)
        return nx.hc_post(f, H, post, comb), P

    def _inv_freq(self, ratio: int, device=None) -> torch.Tensor:
        """The layer type's RoPE frequencies (window-only vs compressed), computed once
        (per device under a placement)."""
        key = (ratio != 0, None if device is None else str(device))
        if key not in self._inv_cache:
            inv = self.nx.rope_inv_freq(self.cfg, ratio)
            self._inv_cache[key] = inv if device is None else inv.to(device)
        return self._inv_cache[key]


__all__ = ["CompressorState", "InputError", "LayerState", "Model", "SequenceState", "moe_experts"]
