"""Drift metrics between a golden tensor and an arm's tensor, all in fp64 on upcast
copies (Numeric Suite silently returns None for bf16; we upcast and say so).

Tensor metrics: relative L2, cosine, SQNR dB, max abs (with location), DeepGEMM diff.
Selections: top-k set recall / Jaccard / golden picks lost. Routing: expert-set agreement.
Logits: llama.cpp-style KLD summary, Δp of the golden top token, same-top-1 rate."""
from __future__ import annotations

import math

import torch

_EPS = 1e-300


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def tensor_metrics(golden: torch.Tensor, arm: torch.Tensor) -> dict:
    """Per-tensor drift of `arm` against `golden` (same shape)."""
    if golden.shape != arm.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs arm {tuple(arm.shape)}")
    g, a = _f64(golden), _f64(arm)
    finite = bool(torch.isfinite(a).all())
    d = a - g
    gn2, an2, dn2 = float((g * g).sum()), float((a * a).sum()), float((d * d).sum())
    dot = float((g * a).sum())
    out = {
        "rel_l2": math.sqrt(dn2) / max(math.sqrt(gn2), _EPS) if finite else math.inf,
        "cosine": dot / max(math.sqrt(gn2 * an2), _EPS) if finite else math.nan,
        "sqnr_db": (10 * math.log10(gn2 / dn2) if dn2 > 0 else math.inf) if finite else -math.inf,
        "deepgemm_diff": (1 - 2 * dot / max(gn2 + an2, _EPS)) if finite else math.inf,
        "finite": finite,
    }
    if d.numel():
        ad = d.abs().nan_to_num(nan=math.inf)
        flat = int(ad.argmax())
        out["max_abs"] = float(ad.flatten()[flat])
        out["max_abs_at"] = list(torch.unravel_index(torch.tensor(flat), d.shape)) if d.dim() else []
        out["max_abs_at"] = [int(i) for i in out["max_abs_at"]]
    else:
        out["max_abs"], out["max_abs_at"] = 0.0, []
    return out


def set_metrics(golden_idx: torch.Tensor, arm_idx: torch.Tensor) -> dict:
    """Row-wise top-k set comparison ([rows, k], -1 = empty). recall = |G∩A|/|G|,
    jaccard = |G∩A|/|G∪A|, lost = golden picks missing from the arm (summed)."""
    if golden_idx.shape[0] != arm_idx.shape[0]:
        raise ValueError("row count mismatch")
    recalls, jacc, lost, rows = [], [], 0, 0
    for g, a in zip(golden_idx.tolist(), arm_idx.tolist()):
        gs = {i for i in g if i >= 0}
        as_ = {i for i in a if i >= 0}
        if not gs and not as_:
            continue
        inter = len(gs & as_)
        rows += 1
        recalls.append(inter / len(gs) if gs else 1.0)
        jacc.append(inter / len(gs | as_))
        lost += len(gs - as_)
    n = max(rows, 1)
    return {"recall": sum(recalls) / n if rows else 1.0, "jaccard": sum(jacc) / n if rows else 1.0,
            "lost": lost, "rows": rows,
            "rows_identical": sum(r == 1.0 for r in jacc)}


def kld_per_position(golden_logits: torch.Tensor, arm_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_golden ‖ P_arm) per position over the full vocabulary, fp64."""
    lg = torch.log_softmax(_f64(golden_logits), -1)
    la = torch.log_softmax(_f64(arm_logits), -1)
    return (lg.exp() * (lg - la)).sum(-1).clamp_min(0.0)


def logits_metrics(golden_logits: torch.Tensor, arm_logits: torch.Tensor) -> dict:
    """llama.cpp's `--kl-divergence` summary: KLD mean ± SE, median, p90/p99/p99.9, max;
    Δp of the golden top token (mean ± SE, RMS); same-top-1 rate ± binomial SE."""
    k = kld_per_position(golden_logits, arm_logits)
    pg = torch.softmax(_f64(golden_logits), -1)
    pa = torch.softmax(_f64(arm_logits), -1)
    top = pg.argmax(-1, keepdim=True)
    dp = (pa.gather(-1, top) - pg.gather(-1, top)).squeeze(-1)
    same = (pa.argmax(-1) == top.squeeze(-1)).double()
    n = k.numel()
    finite = bool(torch.isfinite(_f64(arm_logits)).all())

    def se(x):
        return float(x.std(unbiased=True) / math.sqrt(n)) if n > 1 else math.nan

    q = torch.quantile(k, torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64)) if n else None
    p_same = float(same.mean())
    return {
        "n": n, "finite": finite,
        "kld_mean": float(k.mean()), "kld_se": se(k),
        "kld_median": float(q[0]), "kld_p90": float(q[1]), "kld_p99": float(q[2]),
        "kld_p999": float(q[3]), "kld_max": float(k.max()),
        "dp_mean": float(dp.mean()), "dp_se": se(dp), "dp_rms": float(dp.square().mean().sqrt()),
        "same_top1": p_same, "same_top1_se": math.sqrt(p_same * (1 - p_same) / n) if n else math.nan,
    }


def expert_agreement(golden_experts: torch.Tensor, arm_experts: torch.Tensor) -> dict:
    """Routing: fraction of tokens whose expert SET is identical, and mean overlap."""
    s = set_metrics(golden_experts, arm_experts)
    return {"expert_set_same": s["rows_identical"] / max(s["rows"], 1),
            "expert_overlap": s["recall"]}
