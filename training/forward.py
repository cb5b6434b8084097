"""Batched full-sequence training forward of the golden model (reference_model/model.py).

`Model.extend` runs one sequence on explicit state with gathered sparse attention: right
for inference, slow for training. This is the same network over a [B, T] batch with masks
instead of state: every numerical step is a `Numerics` kernel or a `primitives` function of
reference_model (so a QAT Numerics changes training exactly where it changes inference);
only the orchestration (compressor grouping, attention masks, MoE dispatch) is written
again, batched. `tests/test_tiny_needle.py` checks the logits against `Model.extend`.

Training-only extras, per CSA layer (ratio 4):
* `sparse=False` (dense warm-up): the main attention sees every visible compressed entry,
  as an HCA layer would; the indexer still runs and is trained towards the attention.
* `sparse=True`: the main attention sees the indexer's top-k, as at inference.
* the indexer KL (DeepSeek-V3.2): target = main attention probability mass per compressed
  entry summed over heads, renormalised over the entries the attention saw (stop-gradient);
  prediction = softmax of the index scores over the same entries. The indexer's inputs are
  detached, so its loss trains only the indexer and the LM loss never reaches it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reference_model import primitives as P
from reference_model.config import ModelConfig
from reference_model.model import moe_experts
from reference_model.numerics import Numerics


@dataclass
class ForwardOut:
    logits: torch.Tensor                                   # [B, T, V]
    index_kl: dict[int, torch.Tensor] = field(default_factory=dict)   # CSA layer -> scalar
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # scored layer -> [E]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)   # CSA layer -> indexer picks [B,T,k]
                                                                   # (used only when sparse)


def layer_view(weights: dict, i: int) -> dict:
    p = f"layers.{i}."
    return {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}


class TrainForward:
    def __init__(self, cfg: ModelConfig, nx: Numerics):
        self.cfg, self.nx = cfg, nx
        self._inv = {r: nx.rope_inv_freq(cfg, r) for r in (0, 4)}

    def _table(self, ratio, positions):
        return P.rope_table(positions, self._inv[0 if ratio == 0 else 4])

    def _rope(self, x, table, inverse=False):
        """RoPE on the tail of x; `table` [T, r/2] is laid out to broadcast over x's batch
        (dim 0) and head (dim 2, if any) axes."""
        t = table.unsqueeze(0)
        if x.dim() == 4:
            t = t.unsqueeze(2)
        return self.nx.rs(P.apply_rope(x, t, inverse))

    # ---- whole model ------------------------------------------------------------------
    def __call__(self, weights: dict, tokens: torch.Tensor, sparse: bool = True,
                 kl_weight: torch.Tensor | None = None) -> ForwardOut:
        """weights: native name -> tensor (as the model consumes them); tokens [B, T].
        kl_weight [B, T]: per-query weight of the indexer KL (None: no KL)."""
        cfg, nx = self.cfg, self.nx
        B, T = tokens.shape
        out = ForwardOut(None)
        e = weights["embed.weight"][tokens]
        H = nx.rs(e).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1).flatten(0, 1)   # [B*T, hc, d]
        flat = tokens.flatten()
        for i in range(cfg.n_layers):
            w = layer_view(weights, i)
            x, post, comb = nx.hc_pre(H, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg)
            x = nx.rms_norm(x, w["attn_norm.weight"], cfg.norm_eps)
            a = self._attention(i, w, x.view(B, T, -1), sparse, kl_weight, out)
            H = nx.hc_post(a.flatten(0, 1), H, post, comb)
            x, post, comb = nx.hc_pre(H, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg)
            x = nx.rms_norm(x, w["ffn_norm.weight"], cfg.norm_eps)
            f = self._moe(i, w, x, flat, out)
            H = nx.hc_post(f, H, post, comb)
        x = nx.hc_head(H, weights["hc_head_fn"], weights["hc_head_scale"], weights["hc_head_base"], cfg)
        x = nx.rms_norm(x, weights["norm.weight"], cfg.norm_eps)
        out.logits = nx.lm_head(x, weights["head.weight"]).view(B, T, -1)
        return out

    # ---- attention --------------------------------------------------------------------
    def _attention(self, i, w, x, sparse, kl_weight, out: ForwardOut):
        cfg, nx = self.cfg, self.nx
        B, T, _ = x.shape
        ratio = cfg.compress_ratios[i]
        pos = torch.arange(T, device=x.device)
        table = self._table(ratio, pos)
        qr = nx.rms_norm(nx.fp8_linear(x, w["attn.wq_a.weight"]), w["attn.q_norm.weight"], cfg.norm_eps)
        q = nx.fp8_linear(qr, w["attn.wq_b.weight"]).view(B, T, cfg.n_heads, cfg.head_dim)
        q = self._rope(nx.q_head_rescale(q, cfg.norm_eps), table)
        kvn = P.rms_norm(nx.fp8_linear(x, w["attn.wkv.weight"]), w["attn.kv_norm.weight"],
                         cfg.norm_eps, nx.cd)
        nope = cfg.nope_head_dim
        kv = torch.cat([nx.kv_store(kvn[..., :nope]), self._rope(nx.rs(kvn[..., nope:]), table)], -1)

        comp, cmask, scores = None, None, None
        if ratio:
            comp = self._compress(x, w, "attn.compressor.", ratio, cfg.head_dim, "kv")
            n = comp.shape[1]
            vis = torch.arange(n, device=x.device).unsqueeze(0) < ((pos + 1) // ratio).unsqueeze(1)
            cmask = vis.unsqueeze(0).expand(B, T, n)                            # [B,T,n]
            if ratio == 4:
                scores = self._index_scores(w, x.detach(), qr.detach(), table)  # [B,T,n]
                if n:
                    sel = self._topk(scores.detach().masked_fill(~cmask, float("-inf")))
                    out.topk[i] = sel
                if sparse and n:
                    picked = torch.zeros(B, T, n + 1, dtype=torch.bool, device=x.device)
                    picked.scatter_(2, torch.where(sel >= 0, sel, n), True)
                    cmask = picked[..., :n]
            if n == 0:
                comp, cmask = None, None
        o, pc = self._attend(q, kv, comp, cmask, w["attn.attn_sink"])
        if scores is not None and kl_weight is not None and pc is not None:
            out.index_kl[i] = self._index_kl(scores, pc.detach(), cmask, kl_weight)
        o = self._rope(o, table, inverse=True)
        g = cfg.o_groups
        u = nx.wo_a(o.reshape(B * T, g, -1), w["attn.wo_a.weight"].view(g, cfg.o_lora_rank, -1))
        return nx.fp8_linear(u.reshape(B, T, -1), w["attn.wo_b.weight"])

    def _attend(self, q, kv, comp, cmask, sink):
        """One softmax per query and head over its window rows (t-W+1..t), its compressed
        rows (cmask) and the sink. Queries go in blocks of W against the previous and the
        current block of KV rows, so the window part costs O(T·2W), not O(T²).
        Returns o [B,T,H,D] and the probabilities on compressed rows [B,T,H,n] (or None)."""
        nx, W = self.nx, self.cfg.window_size
        B, T, H, D = q.shape
        nb = -(-T // W)
        pad = nb * W - T
        qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, D)
        kp = F.pad(kv, (0, 0, W, pad)).view(B, nb + 1, W, D)
        keys = torch.cat([kp[:, :-1], kp[:, 1:]], 2)                          # [B,nb,2W,D]
        scale = self.cfg.head_dim ** -0.5
        s = torch.einsum("bnwhd,bnkd->bnwhk", qb, keys) * scale
        wq = torch.arange(W, device=q.device)
        diff = (wq.unsqueeze(1) + W) - torch.arange(2 * W, device=q.device).unsqueeze(0)
        ok = (diff >= 0) & (diff < W)                                          # [W, 2W]
        ok = ok.unsqueeze(0).repeat(nb, 1, 1)
        ok[0, :, :W] = False                                                   # before position 0
        s = s.masked_fill(~ok.view(1, nb, W, 1, 2 * W), float("-inf"))
        parts = [s]
        if comp is not None:
            n = comp.shape[1]
            sc = torch.einsum("bthd,bnd->bthn", q, comp) * scale
            sc = sc.masked_fill(~cmask.unsqueeze(2), float("-inf"))
            parts.append(F.pad(sc, (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, n))
        parts.append(sink.to(s.dtype).view(1, 1, 1, H, 1).expand(B, nb, W, H, 1))
        p = nx.rs(torch.softmax(torch.cat(parts, -1), -1))
        o = torch.einsum("bnwhk,bnkd->bnwhd", p[..., :2 * W], keys)
        pc = None
        if comp is not None:
            pc = p[..., 2 * W:-1].reshape(B, nb * W, H, -1)[:, :T]
            oc = torch.einsum("bthn,bnd->bthd", pc, comp)
            o = o + F.pad(oc, (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, D)
        o = nx.rs(o.reshape(B, nb * W, H, D)[:, :T])
        return o, pc

    # ---- compressor -------------------------------------------------------------------
    def _compress(self, x, w, prefix, ratio, d, kind):
        """All complete groups of x [B,T,dim] -> entries [B, T//ratio, d] (Model._compress
        with an empty state, batched)."""
        cfg, nx = self.cfg, self.nx
        B, T, _ = x.shape
        kv, score = nx.compressor_proj(x, w[prefix + "wkv.weight"], w[prefix + "wgate.weight"])
        ape = w[prefix + "ape"].to(nx.cd)
        score = score + ape[torch.arange(T, device=x.device) % ratio]
        kv, score = nx.compress_state(kv, score)
        g = T // ratio
        if g == 0:
            return kv.new_zeros(B, 0, d)
        gkv = kv[:, : g * ratio].view(B, g, ratio, -1)
        gsc = score[:, : g * ratio].view(B, g, ratio, -1)
        if ratio == 4:          # overlapping: previous group's [0:d] + current group's [d:2d]
            pkv = torch.cat([gkv.new_zeros(B, 1, ratio, 2 * d), gkv[:, :-1]], 1)
            psc = torch.cat([gsc.new_full((B, 1, ratio, 2 * d), float("-inf")), gsc[:, :-1]], 1)
            ckv = torch.cat([pkv[..., :d], gkv[..., d:]], 2)
            csc = torch.cat([psc[..., :d], gsc[..., d:]], 2)
        else:
            ckv, csc = gkv, gsc
        pooled = nx.compress_pool(ckv.flatten(0, 1), csc.flatten(0, 1)).view(B, g, d)
        normed = P.rms_norm(nx.rs(pooled), w[prefix + "norm.weight"], cfg.norm_eps, nx.cd)
        table = self._table(ratio, torch.arange(g, device=x.device) * ratio)
        r = cfg.rope_head_dim
        if kind == "kv":
            return torch.cat([nx.kv_store(normed[..., :-r]), self._rope(nx.rs(normed[..., -r:]), table)], -1)
        return nx.index_key_store(self._rope(nx.rs(normed), table))

    # ---- lightning indexer ------------------------------------------------------------
    def _index_scores(self, w, x, qr, table):
        """Index scores [B,T,n] of every query against every complete group (visibility
        is applied by the caller)."""
        cfg, nx = self.cfg, self.nx
        B, T, _ = x.shape
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = nx.fp8_linear(qr, w["attn.indexer.wq_b.weight"]).view(B, T, h, d)
        q = nx.index_query(self._rope(q, table))
        keys = self._compress(x, w, "attn.indexer.compressor.", 4, d, "index")
        wts = nx.rs(nx.bf16_linear(x, w["attn.indexer.weights_proj.weight"]) * (d ** -0.5 * h ** -0.5))
        return torch.stack([nx.index_scores(q[b], keys[b], wts[b]) for b in range(B)])

    def _topk(self, masked):
        B, T, n = masked.shape
        k = min(self.cfg.index_topk, n)
        return self.nx.index_topk(masked.reshape(B * T, n), k).view(B, T, k)

    @staticmethod
    def _index_kl(scores, pc, cmask, weight):
        """Weighted mean over queries of KL(attention mass || softmax(index scores)), both
        over the compressed entries the attention saw (cmask)."""
        mass = pc.sum(2).masked_fill(~cmask, 0.0)                             # [B,T,n]
        tot = mass.sum(-1, keepdim=True)
        has = (cmask.any(-1)) & (tot.squeeze(-1) > 0)
        target = mass / tot.clamp_min(1e-30)
        logq = torch.log_softmax(scores.float().masked_fill(~cmask, float("-inf")), -1)
        kl = (target * (torch.log(target.clamp_min(1e-30)) - logq.clamp_min(-1e4))).masked_fill(~cmask, 0).sum(-1)
        wgt = weight * has
        return (kl * wgt).sum() / wgt.sum().clamp_min(1e-9)

    # ---- MoE ----------------------------------------------------------------------------
    def _moe(self, i, w, x, tokens, out: ForwardOut):
        cfg, nx = self.cfg, self.nx
        scores = nx.moe_gate(x, w["ffn.gate.weight"], cfg.score_func)
        hashed = cfg.is_hash_layer(i)
        bias = None if hashed else w["ffn.gate.bias"]
        idx = nx.moe_select(scores.detach(), bias, tokens, w.get("ffn.gate.tid2eid"),
                            cfg.n_activated_experts, i, hashed)
        if not hashed:
            out.expert_load[i] = torch.bincount(idx.flatten(), minlength=cfg.n_routed_experts)
        weights = nx.route_weights(scores, idx, bias, cfg.route_scale,
                                   renormalize=cfg.score_func != "softmax")
        return moe_experts(nx, cfg, w, x, idx, weights)
