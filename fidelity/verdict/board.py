"""The verdict as a reader sees it, shared by the ab, kld and engines reports: the signals
board (each arm's signals over their floors) and the suspects (each factor's strongest
signal against its floor)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def suspects(verdict_table: pd.DataFrame, limit: int = 8) -> pd.DataFrame:
    """Each toggle's strongest signal against its floor, strongest first: named ones (their
    interval clears the floor) then the rest."""
    if verdict_table.empty:
        return verdict_table
    v = verdict_table.copy()
    v["rank"] = v["clears"].astype(int) * 1e9 + v["x_floor"].replace(np.inf, 1e8).fillna(0)
    best = v.sort_values("rank", ascending=False).drop_duplicates("toggle").head(limit)
    kind = best["kind"] if "kind" in best else pd.Series("outcome", index=best.index)
    return pd.DataFrame({"toggle": best.toggle, "kind": kind, "signal": best.signal, "where": best["where"],
                         "method": best.method, "value": best.value, "ci_low": best.lo, "ci_high": best.hi,
                         "floor": best.floor_hi, "x_floor": best.x_floor, "named": best.clears}
                        ).reset_index(drop=True)


def signal_ratios(sig_summary: pd.DataFrame, verdict: pd.DataFrame, arms: list[str]) -> pd.DataFrame:
    """Arm × "signal @ place": mean / highest floor's upper bound. NaN where there is
    nothing to compare (no floor for that place, or 0 against a 0 floor); inf where the
    floor is 0 and the arm is not."""
    fl = verdict.drop_duplicates(["signal", "where"]).set_index(["signal", "where"])["floor_hi"] \
        if len(verdict) else pd.Series(dtype=float)
    d = sig_summary[sig_summary.arm.isin(arms)].copy()
    d["col"] = d.signal + " @ " + d["where"].str.replace("final logits", "logits")
    floor = np.asarray(d.set_index(["signal", "where"]).index.map(lambda k: fl.get(k, np.nan)), float)
    mean = d["mean"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(floor > 0, mean / floor, np.where(mean > 0, np.inf, np.nan))
    d["ratio"] = np.where(np.isnan(floor), np.nan, ratio)
    piv = d.pivot_table(index="arm", columns="col", values="ratio", aggfunc="first", dropna=False)
    return piv.reindex([a for a in arms if a in piv.index])


def signal_board(sig_summary: pd.DataFrame, verdict: pd.DataFrame, arms: list[str]):
    """Arm × (signal, place) heat map of mean / highest floor's upper bound (log10); grey
    where there is no data (or 0 against a 0 floor), so "nothing to say" never looks like
    "far below the floor"."""
    piv = signal_ratios(sig_summary, verdict, arms)
    z = np.ma.masked_invalid(np.log10(piv.to_numpy(dtype=float).clip(1e-3, 1e4)))
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#cfcfcf")
    fig, ax = plt.subplots(figsize=(2.5 + 0.42 * piv.shape[1], 2.2 + 0.3 * len(piv)))
    im = ax.imshow(z, aspect="auto", cmap=cmap, vmin=-2, vmax=2)
    ax.set_yticks(range(len(piv)), piv.index, fontsize=8)
    ax.set_xticks(range(piv.shape[1]), piv.columns, rotation=60, ha="right", fontsize=8)
    ax.set_xlabel("signal @ place (grey: no data, or 0 vs a floor of 0)")
    fig.colorbar(im, ax=ax, label="log10(mean / floor)", shrink=min(1.0, 0.3 + 0.07 * len(piv)))
    fig.tight_layout()
    return fig
