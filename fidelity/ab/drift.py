"""Drift in the tidy lockstep tables: as a multiple of the noise floor, and the first
divergent layer of each arm. (Per-prompt outcomes for attribution and the verdict are
fidelity.verdict.)"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

# Order of the taps inside one layer, as the forward produces them.
TAP_ORDER = ("hc_attn.comb", "attn.kv", "attn.index.topk", "attn.out", "hc_ffn.comb",
             "ffn.router.experts", "ffn.out", "out")
# taps first divergence walks through (the final logits count as the layer after the last)
DIVERGENCE_TAPS = TAP_ORDER + ("logits",)
# taps whose departure is a set difference (indexer picks, expert sets), not a rel L2
DISCRETE_TAPS = ("attn.index.topk", "ffn.router.experts")
KEYS = ["prompt", "phase", "step", "layer", "tap", "bucket"]


def with_floor_multiple(drift: pd.DataFrame, floor_arm: str) -> pd.DataFrame:
    """Adds `x_floor` = rel_l2 / floor arm's rel_l2 on the same prompt/phase/step/layer/tap/bucket."""
    if drift.empty or "rel_l2" not in drift:
        return drift.assign(x_floor=np.nan)
    fl = drift[drift.arm == floor_arm][KEYS + ["rel_l2"]].rename(columns={"rel_l2": "floor_rel_l2"})
    out = drift.merge(fl, on=KEYS, how="left")
    out["x_floor"] = out["rel_l2"] / out["floor_rel_l2"].replace(0, np.nan)
    return out


# per tap kind: the column that measures departure (larger = further away)
def _departure(d: pd.DataFrame) -> pd.Series:
    v = d["rel_l2"].astype(float) if "rel_l2" in d else pd.Series(np.nan, index=d.index)
    if "recall" in d:
        v = v.where(d.tap != "attn.index.topk", 1 - d["recall"])
    if "expert_set_same" in d:
        v = v.where(d.tap != "ffn.router.experts", 1 - d["expert_set_same"])
    return v


def _by_place(rows: pd.DataFrame) -> pd.Series:
    """Mean departure per (layer, tap) over the rows (prompts, steps)."""
    return _departure(rows).groupby([rows.layer, rows.tap]).mean()


def first_divergence(drift: pd.DataFrame, arm: str, floor_arm: str, k: float = 2.0,
                     pairs: pd.DataFrame | None = None, vs: str | None = None) -> dict | None:
    """First place, in forward order (prefill first, then decode steps), where the arm
    departs from `vs` (golden when None; another arm through the `pairs` table) by more
    than k × the floor arm's departure from golden there. Departure is rel L2 for tensors,
    1 - recall for indexer picks, 1 - same-expert-set for routing. Non-finite diverges."""
    for phase in ("prefill", "decode"):
        d = drift[(drift.phase == phase) & (drift.bucket == "all") & drift.tap.isin(DIVERGENCE_TAPS)]
        if vs is None or vs == "golden":
            a = d[d.arm == arm]
        else:
            if pairs is None or pairs.empty:
                return None
            a = pairs[(pairs.arm == arm) & (pairs.vs == vs) & (pairs.phase == phase)
                      & pairs.tap.isin(DIVERGENCE_TAPS)]
        if a.empty:
            continue
        av, fv = _by_place(a), _by_place(d[d.arm == floor_arm])
        for lt in sorted(av.index, key=lambda lt: (lt[0], DIVERGENCE_TAPS.index(lt[1]))):
            va, vr = float(av[lt]), float(fv.get(lt, np.nan))
            vr = vr if np.isfinite(vr) else 0.0
            if not np.isfinite(va) or (va > k * vr and va > 0):
                return {"arm": arm, "vs": vs or "golden", "phase": phase, "layer": int(lt[0]),
                        "tap": lt[1], "departure": va, "floor": vr,
                        "ratio": va / vr if vr > 0 and np.isfinite(va) else np.inf}
    return None


def largest_departure(drift: pd.DataFrame, arm: str, floor_arm: str) -> dict | None:
    """The tensor tap where the arm departs from golden by the largest multiple of the floor
    arm's departure there (mean over prompts, prefill and decode; finite, floor > 0): what
    to say about an arm that never reaches first_divergence's bar."""
    d = drift[(drift.bucket == "all") & drift.tap.isin(DIVERGENCE_TAPS) & ~drift.tap.isin(DISCRETE_TAPS)]
    best = None
    for phase in ("prefill", "decode"):
        p = d[d.phase == phase]
        a, f = p[p.arm == arm], p[p.arm == floor_arm]
        if a.empty or f.empty:
            continue
        ratio = _by_place(a) / _by_place(f).replace(0, np.nan)
        ratio = ratio[np.isfinite(ratio)]
        if len(ratio) and (best is None or ratio.max() > best["ratio"]):
            layer, tap = ratio.idxmax()
            best = {"arm": arm, "vs": "golden", "phase": phase, "layer": int(layer), "tap": tap,
                    "ratio": float(ratio.max())}
    return best


def steadiness(drift: pd.DataFrame, arm: str, floor_arm: str, phase: str, layer: int, tap: str) -> dict | None:
    """Is a departure steady across prompts? At one place: per prompt, the arm's departure
    over the floor arm's (means over that prompt's steps); `above`: prompts where the arm
    departs further than the floor, of `n`; `p`: one-sided sign test of that count (a
    departure the size of the floor's noise is above it on about half the prompts);
    `lo`/`median`/`hi`: the per-prompt multiples (finite ones). None without rows."""
    d = drift[(drift.phase == phase) & (drift.bucket == "all") & (drift.layer == layer) & (drift.tap == tap)]
    a = _departure(d[d.arm == arm]).groupby(d[d.arm == arm].prompt).mean()
    f = _departure(d[d.arm == floor_arm]).groupby(d[d.arm == floor_arm].prompt).mean()
    both = pd.concat([a.rename("a"), f.rename("f")], axis=1).dropna()
    if both.empty:
        return None
    above = int((both.a > both.f).sum())
    x = (both.a / both.f.replace(0, np.nan))
    x = x[np.isfinite(x)]
    return {"n": len(both), "above": above,
            "p": float(stats.binomtest(above, len(both), 0.5, alternative="greater").pvalue),
            "lo": float(x.min()) if len(x) else np.nan, "median": float(x.median()) if len(x) else np.nan,
            "hi": float(x.max()) if len(x) else np.nan}


def departure_at(drift: pd.DataFrame, arm: str, phase: str, layer: int, tap: str) -> float | None:
    """The arm's mean departure from golden at one place (None where it has no row)."""
    d = drift[(drift.arm == arm) & (drift.phase == phase) & (drift.bucket == "all")
              & (drift.layer == layer) & (drift.tap == tap)]
    return float(_departure(d).mean()) if len(d) else None
