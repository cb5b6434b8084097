"""The MoE FFN of both versions: router (hash or scored), routed experts summed in fp32 in
expert-index order, the shared expert, combined. The experts' GEMMs are the version's
(reference_model/gemm.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .gemm import Gemm128


def moe(nx, cfg, gemm, i: int, w: dict, x, tokens, t=None):
    """Layer i's MoE on x (bf16 values in the compute dtype); `t` taps router picks."""
    scores = nx.moe_gate(x, w["ffn.gate.weight"], cfg.score_func)
    hashed = cfg.is_hash_layer(i)
    bias = None if hashed else w["ffn.gate.bias"]
    idx = nx.moe_select(scores, bias, tokens, w.get("ffn.gate.tid2eid"),
                        cfg.n_activated_experts, i, hashed)
    weights = nx.route_weights(scores, idx, bias, cfg.route_scale,
                               renormalize=cfg.score_func != "softmax")
    if t:
        t("ffn.router.experts", idx), t("ffn.router.weights", weights)
    return moe_experts(nx, cfg, w, x, idx, weights, gemm)


def moe_experts(nx, cfg, w: dict, x, idx, weights, gemm=None):
    """Routed experts summed in fp32 in expert-index order (out-of-place, so autograd can
    train through it), plus the shared expert, combined. idx/weights [n, top-k]. `gemm`:
    the version's expert GEMMs (default V4's)."""
    gemm = gemm or Gemm128(SimpleNamespace(nx=nx))
    y = torch.zeros(x.shape[0], cfg.dim, dtype=nx.cd, device=x.device)
    for e in range(cfg.n_routed_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        out = gemm.expert(x[tok], w, f"ffn.experts.{e}.", weights[tok, slot], cfg.swiglu_limit, False)
        # in place when autograd is not recording (inference): the same sums, no copy of y
        grad = torch.is_grad_enabled() and (y.requires_grad or out.requires_grad)
        y = y.index_add(0, tok, out) if grad else y.index_add_(0, tok, out)
    shared = None
    if cfg.n_shared_experts:
        shared = gemm.expert(x, w, "ffn.shared_experts.", None, cfg.swiglu_limit, True)
    return nx.moe_combine(y, shared)
