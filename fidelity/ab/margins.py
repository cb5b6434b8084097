"""Selection margins: how close the needle's compressed entry sits to the indexer's top-k
boundary at the question, and how much an arm moves the indexer's scores there.

Recall sweeps see a lost needle only once it is lost; the margin sees it coming. At the
question's last token and per CSA layer: the needle entry's score and rank among the
visible entries, and its margin -- score minus the best score outside the top-k when it is
inside (how far it can fall before it is displaced), score minus the k-th score when it is
outside (negative). An arm perturbs every score by up to max |Δscore| against golden; a
needle entry whose golden margin is below twice that (the needle's score down, the
boundary entry's up) is *fragile* under that arm: one more perturbation of that size at a
longer context could drop it. Works on any checkpoint, no recall sweep needed."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from needle.stats import wilson


def entry_margin(scores: torch.Tensor, held: list[int], k: int) -> dict:
    """{score, rank, margin, n_visible} of the best-scored visible entry in `held`
    (scores: one query's row over the keys, -inf = not visible). margin is NaN when every
    visible entry is selected (nothing to be displaced by)."""
    v = scores.double()
    vis = torch.isfinite(v)
    cand = [j for j in held if j < len(v) and bool(vis[j])]
    if not cand:
        return {"score": math.nan, "rank": None, "margin": math.nan, "n_visible": int(vis.sum())}
    best = max(cand, key=lambda j: float(v[j]))
    s = float(v[best])
    order = v[vis].sort(descending=True).values
    rank = 1 + int((order > s).sum())
    n = len(order)
    if n <= k:
        margin = math.nan
    elif rank <= k:
        margin = s - float(order[k])          # the best score left outside
    else:
        margin = s - float(order[k - 1])      # the lowest score kept
    return {"score": s, "rank": rank, "margin": margin, "n_visible": n}


def score_shift(golden: torch.Tensor, arm: torch.Tensor) -> dict:
    """|arm - golden| over the entries both see (an arm may hold fewer: a serving bug that
    loses a compressor group): median and max."""
    n = min(len(golden), len(arm))
    golden, arm = golden[:n], arm[:n]
    vis = torch.isfinite(golden) & torch.isfinite(arm)
    if not bool(vis.any()):
        return {"dscore_p50": math.nan, "dscore_max": math.nan}
    d = (arm.double() - golden.double())[vis].abs()
    return {"dscore_p50": float(d.median()), "dscore_max": float(d.max())}


def is_fragile(margin: float | None, shift: float) -> bool | None:
    """|margin| < 2 × shift: the needle entry is within reach of a perturbation of that size
    (its score down by it, the boundary entry's up by it). None without a margin (no needle
    entry visible, or every visible entry selected) or without a shift."""
    if margin is None or math.isnan(margin) or math.isnan(shift):
        return None
    return bool(abs(margin) < 2 * shift)


def margin_fields(golden: torch.Tensor, arm: torch.Tensor, held: list[int], k: int) -> dict:
    """One needle row's margin columns: golden's and the arm's margins, the arm's score
    shift, and whether golden's margin is within twice the arm's largest shift."""
    g, a = entry_margin(golden, held, k), entry_margin(arm, held, k)
    shift = score_shift(golden, arm)
    fragile = is_fragile(g["margin"], shift["dscore_max"])
    return {"golden_score": g["score"], "golden_rank": g["rank"], "golden_margin": g["margin"],
            "score": a["score"], "rank": a["rank"], "margin": a["margin"],
            "n_visible": g["n_visible"], "topk": k, **shift, "fragile": fragile}


def margin_table(needle: pd.DataFrame, golden: str) -> pd.DataFrame:
    """Per arm, CSA layer and length group: trials, golden's median margin and rank, the
    arm's median and largest score shift, and fragility (share of trials whose golden
    margin is within twice the arm's shift) with its Wilson 95% interval."""
    if needle.empty or "golden_margin" not in needle:
        return pd.DataFrame()
    rows = []
    d = needle[needle.arm != golden]
    for (arm, layer, group), g in d.groupby(["arm", "layer", "group"], sort=False):
        f = g.fragile.dropna().astype(bool)
        lo, hi = wilson(int(f.sum()), len(f)) if len(f) else (math.nan, math.nan)
        rows.append({"arm": arm, "layer": int(layer), "group": group, "n": len(g),
                     "golden_rank_median": float(g.golden_rank.median()),
                     "golden_margin_median": float(g.golden_margin.median()),
                     "dscore_p50": float(g.dscore_p50.median()), "dscore_max": float(g.dscore_max.max()),
                     "fragile": float(f.mean()) if len(f) else math.nan, "fragile_lo": lo, "fragile_hi": hi})
    return pd.DataFrame(rows)


def margin_trend(needle: pd.DataFrame, golden: str) -> pd.DataFrame:
    """Per CSA layer: golden's median margin per prompt length and a least-squares line in
    log2(length), evaluated at 2x and 4x the longest length -- an extrapolation, labelled
    as one, of where the margins are heading."""
    if needle.empty or "golden_margin" not in needle:
        return pd.DataFrame()
    g = needle[(needle.arm == golden) & needle.golden_margin.notna()]
    rows = []
    for layer, d in g.groupby("layer"):
        per = d.groupby("length").golden_margin.median()
        if len(per) < 2:
            continue
        x = np.log2(per.index.to_numpy(float))
        slope, icpt = np.polyfit(x, per.to_numpy(float), 1)
        top = float(per.index.max())
        rows.append({"layer": int(layer), "lengths": ", ".join(str(int(v)) for v in per.index),
                     "median_margins": ", ".join(f"{v:.3g}" for v in per),
                     "slope_per_doubling": float(slope),
                     "extrapolated_2x": float(icpt + slope * math.log2(2 * top)),
                     "extrapolated_4x": float(icpt + slope * math.log2(4 * top))})
    return pd.DataFrame(rows)
