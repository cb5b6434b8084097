"""V4's mHC, MoE, head and request-level kernels of the seam: methods of every Numerics
(numerics.py: its base class), kept apart from the attention-side kernels. They use
Numerics' rs / r32 / c / _blocked / _rows_rounded; the values are the reference's, as
documented in numerics.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .primitives import sinkhorn_split


def _row_elems(x: torch.Tensor) -> int:
    """Elements per row of x (its first dim's rows), for the row blocking."""
    return x.numel() // max(1, x.shape[0]) if x.dim() else 1


class MixMoeKernels:
    # ---- mHC ----------------------------------------------------------------------------
    def _hc_mixes(self, X, fn, eps):
        Xc = self.c(X)
        r = torch.rsqrt(Xc.square().mean(-1, keepdim=True) + eps)
        return (Xc @ fn.to(self.cd).T) * r

    def hc_pre(self, H, fn, scale, base, cfg):
        """mHC pre: fp32 GEMM of the flattened stream, Sinkhorn, weighted collapse.
        H [n,hc,d] -> (x [n,d], post [n,hc], comb [n,hc,hc])."""
        n, hc, d = H.shape
        blocks = self._blocked(hc * d, H, fn)
        if len(blocks) == 1:
            mixes = self._hc_mixes(H.reshape(n, hc * d), fn, cfg.norm_eps)
        else:
            fn = fn.to(self.cd)
            mixes = torch.cat([self._hc_mixes(H[a:b].reshape(b - a, hc * d), fn, cfg.norm_eps)
                               for a, b in blocks])
        return self.hc_collapse(H, self.r32(mixes), scale, base, cfg)

    def hc_collapse(self, H, mixes, scale, base, cfg):
        """hc_pre after its GEMM (a helper, not a kernel: a toggle that computes the mixes
        another way reuses it): Sinkhorn, then the weighted collapse of the streams."""
        hc = H.shape[1]
        pre, post, comb = (self.r32(t) for t in sinkhorn_split(
            mixes, scale.to(self.cd), base.to(self.cd), hc, cfg.hc_sinkhorn_iters, cfg.hc_eps))
        blocks = self._blocked(_row_elems(H), H, pre)
        x = self._rows_rounded(blocks, (H.shape[0], H.shape[2]), H.device,
                               lambda a, b: (pre[a:b].unsqueeze(-1) * self.c(H[a:b])).sum(1))
        return x, post, comb

    def hc_post(self, a, H, post, comb):
        """H_new[k] = post_k·a + Σ_j comb[j,k]·H[j] in fp32, one bf16 cast."""
        blocks = self._blocked(_row_elems(H), a, H, post, comb)
        return self._rows_rounded(blocks, H.shape, H.device,
                                  lambda i, j: self._hc_post_rows(a[i:j], H[i:j], post[i:j], comb[i:j]))

    def _hc_post_rows(self, a, H, post, comb):
        """hc_post before its rounding."""
        Hc = self.c(H)
        mixed = torch.einsum("njk,njd->nkd", comb.to(self.cd), Hc)
        return post.to(self.cd).unsqueeze(-1) * self.c(a).unsqueeze(1) + mixed

    def hc_head(self, H, fn, scale, base, cfg):
        """Final collapse of the stream: sigmoid pre-weights only (no Sinkhorn)."""
        n, hc, d = H.shape
        mixes = self.r32(self._hc_mixes(H.reshape(n, hc * d), fn, cfg.norm_eps))
        pre = self.r32(torch.sigmoid(mixes * scale.to(self.cd) + base.to(self.cd)) + cfg.hc_eps)
        return self.rs((pre.unsqueeze(-1) * self.c(H)).sum(1))

    # ---- MoE ----------------------------------------------------------------------------
    def moe_gate(self, x, w, score_func):
        """Router scores: fp32 logits of the bf16 input, then the score function."""
        logits = self.r32(self.c(x) @ w.to(self.cd).T)
        if score_func == "sqrtsoftplus":
            return self.r32(F.softplus(logits).sqrt())
        if score_func == "sigmoid":
            return self.r32(logits.sigmoid())
        return self.r32(logits.softmax(-1))

    def moe_select(self, scores, bias, tokens, tid2eid, k: int, layer: int, hash_layer: bool):
        """Experts per token: hash layers take tid2eid[token id] (no scores, no bias); the
        others top-k of score + bias (the bias only steers selection)."""
        if hash_layer:
            return tid2eid[tokens].long()
        return torch.topk(scores + bias.to(scores.dtype), k, dim=-1).indices

    def route_weights(self, scores, idx, bias, route_scale, renormalize=True):
        """Unbiased scores of the chosen experts (also on hash layers), renormalised, times
        route_scale (fp32). scores [n, E], idx [n, k]; `bias` (None on hash layers) is
        not used by the reference: it is here for engines that get this wrong."""
        w = scores.gather(-1, idx)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return self.r32(w * route_scale)

    def swiglu(self, g, u, limit):
        """silu(gate)·up with the asymmetric clamp: up in [-l, l], gate <= l (no lower
        bound on the gate); limit 0 = no clamp. fp32."""
        if limit > 0:
            u = u.clamp(-limit, limit)
            g = g.clamp(max=limit)
        return F.silu(g) * u

    def expert_ffn(self, x, w1, w3, w2, weight, limit):
        """SwiGLU expert: gate/up GEMMs, `swiglu`, routing weight applied to the fp32
        intermediate before w2; bf16 output. `weight` [n] or None (shared)."""
        h = self.swiglu(self.fp8_linear(x, w1), self.fp8_linear(x, w3), limit)
        if weight is not None:
            h = weight.to(self.cd).unsqueeze(-1) * h
        return self.fp8_linear(self.rs(h), w2)

    def moe_combine(self, routed_sum, shared):
        """Routed outputs were summed in fp32 (expert-index order); add the shared expert in
        fp32, cast once."""
        y = routed_sum if shared is None else routed_sum + shared
        return self.rs(y)

    # ---- head ---------------------------------------------------------------------------
    def lm_head(self, x, w):
        """fp32 logits: bf16 hidden times the fp32 head weight."""
        logits = self.c(x) @ w.to(self.cd).T
        return logits.float() if self.quant else logits

    # ---- request level: how a chat request becomes a prompt ----------------------------------
    def chat_request(self, body: dict):
        """The request as the engine reads it (golden: DeepSeek's reading of the fields)."""
        from .chat_encoding import ChatRequest, request_state
        thinking, effort = request_state(body)
        return ChatRequest(body.get("messages"), body.get("tools"), thinking, effort)

    def chat_render(self, req, generation: str = "0731", add_generation_prompt: bool = True):
        """The prompt for a request as read: DeepSeek's own encoder (deepseek-recipe)."""
        from .chat_encoding import render
        return render(req, generation, add_generation_prompt)
