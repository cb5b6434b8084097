"""Selection margins over captures: how close the needle's compressed entry sits to the
indexer's top-k boundary at the question (the last prompt position), and how far an arm
demonstrably moves the indexer's scores there -- from its picks alone, so it works on any
arm that returns captures, HTTP engines included (engines return picks, never scores).

The baseline's margin (fidelity.ab.margins.entry_margin on the baseline's score row,
which the in-process scorer keeps: golden's when the baseline is golden) says how far the
needle entry can move before it changes sides. The arm's implied perturbation ε is a
lower bound on max_j |Δscore_j| (arm vs baseline): for an entry j the arm dropped (in the
baseline's picks, not the arm's) and an entry i it added, with baseline scores s_j > s_i,
the arm must rank i above j, so s_j + Δ_j <= s_i + Δ_i, hence Δ_i - Δ_j >= s_j - s_i and
max |Δ| >= (s_j - s_i)/2. The tightest such pair gives ε = max(0, (max_dropped s_j -
min_added s_i) / 2); equal pick sets give 0 (no evidence, not proof of equal scores).
A needle entry with |margin| < 2ε is *fragile*: a perturbation of the size the arm has
shown could move it across the boundary (the same rule as `fidelity ab`'s, whose shift
is measured rather than bounded)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from fidelity.ab.margins import entry_margin, is_fragile
from needle.haystack import needle_entries

from fidelity.scores.dialects import PromptScores


def implied_perturbation(scores, base_picks, arm_picks) -> float:
    """ε: the smallest max-norm score perturbation of `scores` (the baseline's row, -inf =
    not visible) that could turn the baseline's picks into the arm's -- a lower bound on
    the arm's true perturbation (module doc). Only entries the baseline sees count: picks
    of entries it cannot see (padding ties, an arm reading what it should not see, or on
    V4.1 entries outside the baseline's candidate blocks) are no score perturbation and
    show in topk_loss instead."""
    s = np.asarray(scores, np.float64)
    seen = lambda picks: {int(j) for j in picks if 0 <= j < len(s) and np.isfinite(s[j])}
    base, arm = seen(base_picks), seen(arm_picks)
    dropped, added = base - arm, arm - base
    if not dropped or not added:
        return 0.0
    return max(0.0, (max(s[j] for j in dropped) - min(s[i] for i in added)) / 2)


def margin_rows(base: PromptScores, arm: PromptScores, csa_layers: list[int], topk: int,
                needle_tokens=(), ratios: list[int] | None = None) -> list[dict]:
    """Per CSA layer at the last prompt position: the baseline's needle-entry margin (NaN
    when the prompt has no needle entry visible), the arm's implied perturbation ε and the
    fragile flag. Empty when the baseline kept no scores (an endpoint baseline) or either
    side has no captures."""
    if base.index_scores is None or base.indexer is None or arm.indexer is None:
        return []
    n = len(base.ids)
    rows = []
    for c, layer in enumerate(csa_layers):
        s = base.index_scores[c]
        eps = implied_perturbation(s, base.indexer[n - 1, c], arm.indexer[n - 1, c])
        ratio = ratios[layer] if ratios else 4
        held = needle_entries(needle_tokens, n - 1, ratio) if len(needle_tokens) else []
        margin = entry_margin(torch.from_numpy(s), held, topk)["margin"] if held else math.nan
        rows.append({"layer": layer, "golden_margin": margin, "eps": eps,
                     "fragile": is_fragile(margin, eps)})
    return rows


def margin_summary(margins: pd.DataFrame) -> pd.DataFrame:
    """Per arm and CSA layer over prompts: prompts, those with a needle margin, the median
    margin, median and largest ε (lower bounds), and the fragile share of the prompts with
    a margin."""
    cols = ["arm", "layer", "prompts", "with_margin", "golden_margin_median", "eps_median",
            "eps_max", "fragile"]
    if margins is None or not len(margins):
        return pd.DataFrame(columns=cols)
    rows = []
    for (arm, layer), g in margins.groupby(["arm", "layer"], sort=False):
        m = g.golden_margin.dropna()
        f = g.fragile.dropna().astype(bool)
        rows.append({"arm": arm, "layer": int(layer), "prompts": len(g), "with_margin": len(m),
                     "golden_margin_median": float(m.median()) if len(m) else math.nan,
                     "eps_median": float(g.eps.median()), "eps_max": float(g.eps.max()),
                     "fragile": float(f.mean()) if len(f) else math.nan})
    return pd.DataFrame(rows, columns=cols)
