"""Line styles shared by the reports' plots: each arm its own (colour, line style,
marker) so 40 lines stay distinct, floors in greys drawn hollow above the arms, curves
that hide one another found (`same_as`) so the legend can say so, and font sizes that stay
readable at the size a page shows a figure (`readable`)."""
from __future__ import annotations

import functools

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

COLORS = list(plt.get_cmap("tab10").colors)
LINES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
FLOOR_MARKERS = ["s", "D", "^", "v"]
# readable at the page's size: a figure shown at most at its own width (dpi 110) keeps
# 10 pt text at ~15 px
RC = {"font.size": 10, "axes.labelsize": 10, "xtick.labelsize": 9.5, "ytick.labelsize": 9.5,
      "legend.fontsize": 9, "axes.titlesize": 11}


def readable(fn):
    """Draw `fn`'s figure with the page's font sizes (rc settings apply when text is made)."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with plt.rc_context(RC):
            return fn(*a, **k)
    return wrapper


def arm_styles(arms: list[str], floors=()) -> dict[str, dict]:
    """Arm -> plot keyword arguments: candidates cycle colours, then line styles and
    markers; floors are greys with hollow markers on top (zorder) so they stay visible."""
    out, j = {}, 0
    floors = [f for f in arms if f in set(floors)]
    for a in arms:
        if a in floors:
            k = floors.index(a)
            out[a] = dict(color=str(round(0.1 + 0.22 * (k % 3), 2)), ls=(0, (5, 2)), lw=1.6,
                          marker=FLOOR_MARKERS[k % len(FLOOR_MARKERS)], ms=6, mfc="white", mew=1.4, zorder=5)
        else:
            cyc = j // len(COLORS)
            out[a] = dict(color=COLORS[j % len(COLORS)], ls=LINES[cyc % len(LINES)], lw=1.5,
                          marker=MARKERS[cyc % len(MARKERS)], ms=4.5, zorder=3)
            j += 1
    return out


OVERLAP = 0.01      # curves closer than this share of the plot's span, everywhere, hide each other


def same_as(series: dict[str, pd.Series], log: bool = False) -> dict[str, str]:
    """Arm -> "= b" (the same numbers) or "≈ b" (within OVERLAP of the span at every point,
    on the axis's scale) for the first arm b drawn before it that it would hide under."""
    scaled = {a: (np.log10(s.where(s > 0)) if log else s).astype(float) for a, s in series.items()}
    allv = np.concatenate([v.to_numpy() for v in scaled.values()]) if scaled else np.array([])
    allv = allv[np.isfinite(allv)]
    span = float(allv.max() - allv.min()) if len(allv) else 0.0
    out: dict[str, str] = {}
    seen: list[str] = []
    for a, v in scaled.items():
        for b in seen:
            w = scaled[b]
            if not v.index.equals(w.index):
                continue
            if np.allclose(series[a].to_numpy(float), series[b].to_numpy(float), rtol=1e-9, atol=0, equal_nan=True):
                out[a] = f"= {b}"
                break
            diff = np.abs(v.to_numpy() - w.to_numpy())
            if span > 0 and np.all(np.nan_to_num(diff, nan=np.inf) <= OVERLAP * span):
                out[a] = f"≈ {b}"
                break
        else:
            seen.append(a)
    return out
