"""KL between a baseline P and an arm Q when one or both are known only on some token ids
(docs/research/engine-integration.md §1.4). With S the ids both sides know, T_P = 1 - Σ_S p
and T_Q = 1 - Σ_S q (the rest of the vocabulary, lumped):

  KL(P‖Q) >= Σ_S p log(p/q) + T_P log(T_P/T_Q)      (coarse-graining; exact when S is
                                                     the vocabulary, tight when P ∝ Q off S)

There is no finite upper bound without a floor on q off S, so the bound is reported with
the baseline mass it did not cover (T_P). Total variation is bracketed on both sides;
top-1 agreement and Δp of the token that actually follows are exact whenever both sides
know the top-1 and that token."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Known:
    """The part of one position's distribution a side reported: ids (unique) and their
    log-probabilities (all of the vocabulary for an in-process arm)."""
    ids: np.ndarray
    logp: np.ndarray

    def top1(self) -> int:
        return int(self.ids[int(np.argmax(self.logp))])

    def get(self, token: int) -> float | None:
        hit = np.nonzero(self.ids == token)[0]
        return float(self.logp[hit[0]]) if len(hit) else None


def _xlogy_ratio(a: float, b: float) -> float:
    """a log(a/b) with 0 log 0 = 0; b is floored so a rounding-negative tail stays finite."""
    if a <= 0:
        return 0.0
    return a * (np.log(a) - np.log(max(b, 1e-300)))


def compare(p: Known, q: Known, actual: int | None) -> dict:
    """One position: kl_lb (KL(P‖Q) lower bound), rkl_lb (KL(Q‖P) lower bound),
    uncovered_p (T_P), tv_lo / tv_hi, same_top1 (None when a side's top-1 is unknown),
    dp (q(actual) - p(actual), None when unknown), n_common (|S|), nonfinite (a side
    reported NaN or infinite log-probs, or nothing: then every bound is NaN)."""
    if not (len(p.ids) and len(q.ids) and np.isfinite(p.logp).all() and np.isfinite(q.logp).all()):
        # a side reported NaN or infinite log-probs, or none at all (a server that wrote its
        # non-finite logits as null, read by a parser that skips nulls): no KL bound holds;
        # said, never read as 0
        return {"kl_lb": np.nan, "rkl_lb": np.nan, "uncovered_p": np.nan, "tv_lo": np.nan, "tv_hi": np.nan,
                "n_common": 0, "same_top1": False, "dp": None, "nonfinite": True}
    common, ip, iq = np.intersect1d(p.ids, q.ids, assume_unique=True, return_indices=True)
    lp, lq = p.logp[ip].astype(np.float64), q.logp[iq].astype(np.float64)
    pp, qq = np.exp(lp), np.exp(lq)
    tp, tq = max(0.0, 1.0 - pp.sum()), max(0.0, 1.0 - qq.sum())
    kl = float(np.sum(pp * (lp - lq))) + _xlogy_ratio(tp, tq)
    rkl = float(np.sum(qq * (lq - lp))) + _xlogy_ratio(tq, tp)
    d = float(np.abs(pp - qq).sum())
    out = {"kl_lb": max(kl, 0.0), "rkl_lb": max(rkl, 0.0), "uncovered_p": tp,
           "tv_lo": 0.5 * (d + abs(tp - tq)), "tv_hi": min(1.0, 0.5 * (d + tp + tq)),
           "n_common": len(common), "same_top1": None, "dp": None, "nonfinite": False}
    # a side's top-1 is known when it reported its own top entries (always the case here:
    # every dialect returns each side's top-k, k >= 1)
    if len(p.ids) and len(q.ids):
        out["same_top1"] = p.top1() == q.top1()
    if actual is not None:
        a, b = p.get(actual), q.get(actual)
        if a is not None and b is not None:
            out["dp"] = float(np.exp(b) - np.exp(a))
    return out
