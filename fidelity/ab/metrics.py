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
    return tensor_metrics_rows(golden, arm, [(0, golden.shape[0] if golden.dim() else 1)])[0]


def tensor_metrics_rows(golden: torch.Tensor, arm: torch.Tensor,
                        spans: list[tuple[int, int]]) -> list[dict]:
    """`tensor_metrics` of several row spans (e.g. context-position buckets) in one pass:
    per-row sums in fp64, then summed per span."""
    return tensor_metrics_from_rows(tensor_row_sums(golden, arm), spans, tuple(golden.shape))


def tensor_row_sums(golden: torch.Tensor, arm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row fp64 sums (|g|², |a|², |a-g|², g·a), finiteness and the largest |a-g| with
    its column: everything `tensor_metrics_from_rows` needs, so rows can be reduced a chunk
    at a time (the logits of a long prompt never held whole) and concatenated."""
    if golden.shape != arm.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs arm {tuple(arm.shape)}")
    g, a = _f64(golden), _f64(arm)
    if g.dim() == 0:
        g, a = g.reshape(1), a.reshape(1)
    g2, a2 = g.reshape(g.shape[0], -1), a.reshape(a.shape[0], -1)
    d2 = a2 - g2
    ad = d2.abs().nan_to_num(nan=math.inf)
    rmax, rarg = (ad.max(1) if ad.shape[1] else (torch.zeros(len(ad), dtype=ad.dtype),
                                                  torch.zeros(len(ad), dtype=torch.long)))
    return {"gg": (g2 * g2).sum(1), "aa": (a2 * a2).sum(1), "dd": (d2 * d2).sum(1),
            "ga": (g2 * a2).sum(1), "fin": torch.isfinite(a2).all(1), "rmax": rmax, "rarg": rarg,
            "cols": torch.full((len(ad),), d2.shape[1], dtype=torch.long)}


def tensor_metrics_from_rows(rows: dict[str, torch.Tensor], spans: list[tuple[int, int]],
                             shape: tuple[int, ...]) -> list[dict]:
    """`tensor_metrics` per row span from `tensor_row_sums` rows (of a tensor of `shape`)."""
    gg, aa, dd, ga, fin = rows["gg"], rows["aa"], rows["dd"], rows["ga"], rows["fin"]
    rmax, rarg = rows["rmax"], rows["rarg"]
    cols = int(rows["cols"][0]) if len(rows["cols"]) else 0
    out = []
    for lo, hi in spans:
        finite = bool(fin[lo:hi].all())
        gn2, an2, dn2, dot = (float(t[lo:hi].sum()) for t in (gg, aa, dd, ga))
        m = {
            "rel_l2": math.sqrt(dn2) / max(math.sqrt(gn2), _EPS) if finite else math.inf,
            "cosine": dot / max(math.sqrt(gn2 * an2), _EPS) if finite else math.nan,
            "sqnr_db": (10 * math.log10(gn2 / dn2) if dn2 > 0 else math.inf) if finite else -math.inf,
            "deepgemm_diff": (1 - 2 * dot / max(gn2 + an2, _EPS)) if finite else math.inf,
            "finite": finite,
            "max_abs": 0.0, "max_abs_at": [],
        }
        if hi > lo and cols:
            r = lo + int(rmax[lo:hi].argmax())
            m["max_abs"] = float(rmax[r])
            flat = r * cols + int(rarg[r])
            m["max_abs_at"] = _unravel(flat, shape)
        out.append(m)
    return out


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    """Flat index -> coordinates (torch.unravel_index costs ~1 ms a call)."""
    out = []
    for d in reversed(shape):
        flat, r = divmod(flat, d)
        out.append(r)
    return out[::-1]


def set_metrics(golden_idx: torch.Tensor, arm_idx: torch.Tensor) -> dict:
    """Row-wise top-k set comparison ([rows, k], -1 = empty). recall = |G∩A|/|G|,
    jaccard = |G∩A|/|G∪A|, lost = golden picks missing from the arm (summed)."""
    return set_metrics_rows(golden_idx, arm_idx, [(0, golden_idx.shape[0])])[0]


def set_metrics_rows(golden_idx: torch.Tensor, arm_idx: torch.Tensor,
                     spans: list[tuple[int, int]]) -> list[dict]:
    """`set_metrics` per row span, vectorised (entries within a row are distinct)."""
    if golden_idx.shape[0] != arm_idx.shape[0]:
        raise ValueError("row count mismatch")
    g, a = golden_idx.long(), arm_idx.long()
    gv, av = g >= 0, a >= 0
    hit = ((g.unsqueeze(2) == a.unsqueeze(1)) & gv.unsqueeze(2) & av.unsqueeze(1)).any(2)
    inter = hit.sum(1).double()
    ng, na = gv.sum(1).double(), av.sum(1).double()
    union = ng + na - inter
    used = union > 0
    recall = torch.where(ng > 0, inter / ng.clamp_min(1), torch.ones_like(ng))
    jacc = inter / union.clamp_min(1)
    lost = ng - inter
    out = []
    for lo, hi in spans:
        u = used[lo:hi]
        rows = int(u.sum())
        out.append({"recall": float(recall[lo:hi][u].mean()) if rows else 1.0,
                    "jaccard": float(jacc[lo:hi][u].mean()) if rows else 1.0,
                    "lost": int(lost[lo:hi][u].sum()), "rows": rows,
                    "rows_identical": int((jacc[lo:hi][u] == 1).sum())})
    return out


def kld_per_position(golden_logits: torch.Tensor, arm_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_golden ‖ P_arm) per position over the full vocabulary, fp64."""
    lg = torch.log_softmax(_f64(golden_logits), -1)
    la = torch.log_softmax(_f64(arm_logits), -1)
    return (lg.exp() * (lg - la)).sum(-1).clamp_min(0.0)


def logits_metrics(golden_logits: torch.Tensor, arm_logits: torch.Tensor) -> dict:
    """llama.cpp's `--kl-divergence` summary: KLD mean ± SE, median, p90/p99/p99.9, max;
    Δp of the golden top token (mean ± SE, RMS); same-top-1 rate ± binomial SE."""
    return logits_summary(logit_row_stats(golden_logits, arm_logits))


def logit_row_stats(golden_logits: torch.Tensor, arm_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position: KLD, Δp of the golden top token, same top-1, finite. Rows are
    independent, so a long prompt's logits can be reduced a chunk at a time and the rows
    concatenated; `logits_summary` of them equals `logits_metrics` of the whole."""
    k = kld_per_position(golden_logits, arm_logits)
    pg = torch.softmax(_f64(golden_logits), -1)
    pa = torch.softmax(_f64(arm_logits), -1)
    top = pg.argmax(-1, keepdim=True)
    dp = (pa.gather(-1, top) - pg.gather(-1, top)).squeeze(-1)
    same = (pa.argmax(-1) == top.squeeze(-1)).double()
    finite = torch.isfinite(_f64(arm_logits)).reshape(len(k), -1).all(1)
    return {"kld": k, "dp": dp, "same": same, "finite": finite}


def logits_summary(rows: dict[str, torch.Tensor]) -> dict:
    """`logits_metrics` from `logit_row_stats` rows."""
    k, dp, same = rows["kld"], rows["dp"], rows["same"]
    n = k.numel()
    finite = bool(rows["finite"].all())

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
    return expert_agreement_rows(golden_experts, arm_experts, [(0, golden_experts.shape[0])])[0]


def expert_agreement_rows(golden_experts, arm_experts, spans) -> list[dict]:
    return [{"expert_set_same": s["rows_identical"] / max(s["rows"], 1), "expert_overlap": s["recall"]}
            for s in set_metrics_rows(golden_experts, arm_experts, spans)]
