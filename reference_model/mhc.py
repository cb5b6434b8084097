"""The residual stream's mHC, the version part that differs in where a site's collapse
weights come from (chosen by the config: reference_model.version).

V4 (`PlainHC`): each site collapses its input with its own pre-mix (`hc_pre`), the head has
its own `hc_head`, and the stream between layers is the four copies H.
V4.1 (`LaggedHC`, docs/v41-architecture.md §5.3): each site collapses with the PREVIOUS
site's pre-mix, which travels with H between layers (reference_model/v41/stream.py), and the
head collapses with the last one (no hc_head)."""
from __future__ import annotations

import torch

from .part import ModelPart
from .v41 import stream
from .v41.kernels import identity_pre_mix


class PlainHC(ModelPart):
    """V4's mHC: the stream is H; P (the lagged pre-mix) is always None."""

    def stream_in(self, H):
        return H

    def unpack(self, S):
        return S, None

    def pack(self, H, Ps):
        return H

    def site(self, H, P, w: dict, sub: str):
        """(x collapsed, post, comb, P for the next site) of the `sub` ('attn'/'ffn') site."""
        x, post, comb = self.nx.hc_pre(H, w[f"hc_{sub}_fn"], w[f"hc_{sub}_scale"],
                                       w[f"hc_{sub}_base"], self.cfg)
        return x, post, comb, None

    def after_attention(self, H):
        """The golden hc_post returns storage-dtype values: held as such (lossless, as
        between layers) they cost the FFN's hc_pre/hc_post a quarter of the reads."""
        return H.to(self.nx.sd) if "hc_post" not in self.nx.replaced else H

    def head(self, S, g: dict):
        """The final collapse (hc_head: sigmoid pre-weights, no Sinkhorn)."""
        return self.nx.hc_head(S, g["hc_head_fn"], g["hc_head_scale"], g["hc_head_base"], self.cfg)


class LaggedHC(PlainHC):
    """V4.1's lagged mHC: P rides in the stream tensor; the head collapses with it."""

    def stream_in(self, H):
        """Embedding streams with P_0 = stream 0 (make_identity_pre_mix), packed."""
        P = identity_pre_mix(H.shape[0], self.cfg.hc_mult, device=H.device)
        return stream.pack(H, P, self.nx.sd)

    def unpack(self, S):
        return stream.unpack(S, self.cfg.dim)

    def pack(self, H, Ps):
        return stream.pack(H, torch.cat(Ps, 0), self.nx.sd)

    def site(self, H, P, w: dict, sub: str):
        nx = self.nx
        pre, post, comb = nx.hc_mix(H, w[f"hc_{sub}_fn"], w[f"hc_{sub}_scale"], w[f"hc_{sub}_base"],
                                    self.cfg)
        return nx.hc_pre_lagged(H, P, pre), post, comb, pre

    def after_attention(self, H):
        return H

    def head(self, S, g: dict):
        H, P = self.unpack(S)
        return self.nx.hc_pre_lagged(H, P, P)
