"""Plots of an A/B run: drift vs layer with the noise-floor band, toggle × layer heatmap,
attribution bars with CIs, KLD distribution per arm, indexer top-k recall vs context
position, decode-step drift (the signals board is fidelity.verdict.board). No backend is
forced here: the CLI selects Agg, a notebook keeps its inline one.

Every line plot gives each arm its own (colour, line style, marker): ten colours, then
the next ten dashed with another marker, so 40 arms stay distinct; floors are greys drawn
hollow above the arms (never hidden under them); an arm whose curve is the same as (or
within 1% of the span of) one drawn before it is ringed and says so in the legend
(infra.plot_style). An arm a plot cannot draw (no data, or exactly 0 on a log axis) is
listed in `fig.absent` (arm -> why), for the caption."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.ticker import MaxNLocator

from infra.plot_style import arm_styles, readable, same_as


def _lines(ax, series: dict[str, pd.Series], floors=(), x_shift=0, log=False):
    """Each series in its arm's style; one that another drawn before it would hide gets a
    larger hollow marker around it and says so in the legend ("= b", "≈ b")."""
    styles = arm_styles(list(series), floors)
    dup = same_as(series, log)
    for a, s in series.items():
        st = dict(styles[a])
        label = a
        if a in dup:
            st.update(mfc="none", ms=st["ms"] + 5, mew=1.3, zorder=6)
            label = f"{a} ({dup[a]})"
        ax.plot(s.index + x_shift, s.to_numpy(float), label=label, **st)


def _legend_below(ax):
    """Legend under the axes in columns, so the plot keeps the page's width."""
    n = len(ax.get_legend_handles_labels()[1])
    if n:
        ax.legend(ncol=min(4, max(1, (n + 5) // 6)), loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  frameon=False)


def _positive(series: dict[str, pd.Series], what: str, absent: dict) -> dict[str, pd.Series]:
    """Series for a log axis: zeros dropped; an arm left with no point goes to `absent`."""
    out = {}
    for a, s in series.items():
        s = s.replace(0, np.nan)
        if len(s) and s.notna().any():
            out[a] = s
        else:
            absent[a] = what if len(s) else "no data"
    return out


@readable
def drift_vs_layer(drift: pd.DataFrame, floor_arm: str, arms: list[str], tap="out", phase="prefill",
                   floors=()):
    d = drift[(drift.tap == tap) & (drift.phase == phase) & (drift.bucket == "all")]
    fig, ax = plt.subplots(figsize=(9, 5))
    fl = d[d.arm == floor_arm].groupby("layer")["rel_l2"]
    if len(fl):
        lo, hi = fl.min(), fl.max()
        ax.fill_between(lo.index, lo.values, hi.values, color="0.88", zorder=1,
                        label=f"{floor_arm}: min–max over prompts")
    absent: dict[str, str] = {}
    series = {a: d[d.arm == a].groupby("layer")["rel_l2"].mean() for a in arms}
    _lines(ax, _positive(series, "exactly 0 at every layer (identical to golden)", absent), floors, log=True)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"relative L2 of {tap} vs golden")
    ax.grid(alpha=.3, which="both")
    _legend_below(ax)
    fig.absent = absent
    return fig


@readable
def toggle_layer_heatmap(drift: pd.DataFrame, arms: list[str], tap="out", phase="prefill"):
    """log colour scale over the non-zero cells only; an exact 0 (identical to golden) is
    white and written "0", no data grey, and every cell carries its value."""
    d = drift[(drift.tap == tap) & (drift.phase == phase) & (drift.bucket == "all") & drift.arm.isin(arms)]
    piv = d.groupby(["arm", "layer"])["rel_l2"].mean().unstack("layer").reindex(arms)
    v = piv.to_numpy(dtype=float)
    pos = v[np.isfinite(v) & (v > 0)]
    fig, ax = plt.subplots(figsize=(3.2 + 0.9 * max(1, piv.shape[1]), 1.2 + 0.42 * len(arms)))
    ax.set_facecolor("#d9d9d9")                                     # no data
    norm = LogNorm(pos.min(), max(pos.max(), pos.min() * 1.0001)) if len(pos) else None
    im = ax.imshow(np.ma.masked_where(~(v > 0), v), aspect="auto", cmap="magma_r", norm=norm)
    ax.imshow(np.ma.masked_where(v != 0, np.ones_like(v)), aspect="auto", cmap="Greys", vmin=0, vmax=10)
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            x = v[i, j]
            text = "–" if not np.isfinite(x) else "0" if x == 0 else f"{x:.2g}"
            dark = norm is not None and x > 0 and norm(x) > 0.55
            ax.text(j, i, text, ha="center", va="center", fontsize=8.5, color="white" if dark else "black")
    ax.set_yticks(range(len(arms)), arms)
    ax.set_xticks(range(piv.shape[1]), [str(c) for c in piv.columns])
    ax.set_xlabel("layer")
    if norm is not None:
        fig.colorbar(im, ax=ax, label=f"relative L2 of {tap} vs golden (log; white 0 = identical)")
    fig.tight_layout()
    return fig


ATTRIBUTION_METHODS = ("shapley", "one_at_a_time", "leave_one_out", "added_to_base", "under_schedule")


@readable
def attribution_bars(attr: pd.DataFrame, floor_hi: float, floor_label: str = "noise floor"):
    """One panel per method (every method in `attr`: shapley, one-at-a-time, leave-one-out,
    added-to-base, ...), bars red where the interval clears the floor."""
    methods = [m for m in ATTRIBUTION_METHODS if m in set(attr.method)]
    methods += sorted(set(attr.method) - set(methods))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.6 * len(methods), 1.4 + 0.4 * attr.toggle.nunique()),
                             squeeze=False, sharey=False)
    for ax, m in zip(axes[0], methods):
        a = attr[attr.method == m].sort_values("value")
        y = np.arange(len(a))
        err = np.vstack([a.value - a.lo, a.hi - a.value]).clip(0)
        ax.barh(y, a.value, xerr=err, color=np.where(a.lo > floor_hi, "#d62728", "#7f7f7f"), capsize=2)
        ax.axvline(floor_hi, color="k", ls="--", lw=1.2, label=floor_label)
        ax.set_yticks(y, a.toggle)
        ax.set_title(m.replace("_", "-"))
        ax.set_xlabel("Δ mean final-logit KLD")
        ax.legend(loc="best")
    fig.tight_layout()
    return fig


@readable
def kld_distribution(kld: pd.DataFrame, arms: list[str], phase="prefill"):
    """Box per arm on a log axis of its positive KLDs; the share of exact zeros (no point on
    a log axis) is written beside the arm's name."""
    d = kld[(kld.phase == phase) & kld.arm.isin(arms)]
    absent: dict[str, str] = {}
    data, labels = [], []
    for a in arms:
        x = d[d.arm == a].kld.to_numpy(float)
        pos = x[x > 0]
        if not len(pos):
            absent[a] = "no data" if not len(x) else "KLD exactly 0 at every position"
            continue
        zeros = 1 - len(pos) / len(x)
        data.append(pos)
        labels.append(a + (f" ({zeros:.0%} exactly 0)" if zeros >= 0.005 else ""))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.4 * max(1, len(data))))
    if data:
        ax.boxplot(data, orientation="horizontal", whis=(1, 99), showfliers=False)
        ax.set_yticks(range(1, len(data) + 1), labels)
        ax.set_xscale("log")
        ax.invert_yaxis()                                           # the first arm on top
    ax.set_xlabel("KLD(golden ‖ arm) per position (box: quartiles, whiskers: p1–p99)")
    ax.grid(alpha=.3, axis="x", which="both")
    fig.absent = absent
    return fig


@readable
def topk_recall_vs_position(drift: pd.DataFrame, arms: list[str], floors=()):
    d = drift[(drift.tap == "attn.index.topk") & (drift.phase == "prefill") & (drift.bucket != "all")
              & drift.arm.isin(arms)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    fig.absent = {}
    if d.empty:
        ax.text(.5, .5, "no CSA layer captured", ha="center")
        fig.absent = dict.fromkeys(arms, "no CSA layer captured")
        return fig
    d = d.assign(start=d.bucket.str.split("-").str[0].astype(int))
    series = {}
    for a in arms:
        s = d[d.arm == a].groupby("start")["recall"].mean()
        if len(s) and s.notna().any():
            series[a] = s
        else:
            fig.absent[a] = "no indexer rows"
    _lines(ax, series, floors, x_shift=1)
    ax.set_xscale("log")
    ax.set_xlabel("context position (bucket start + 1)")
    ax.set_ylabel("indexer top-k recall vs golden\n(mean over CSA layers)")
    ax.grid(alpha=.3)
    _legend_below(ax)
    return fig


@readable
def decode_drift(kld: pd.DataFrame, arms: list[str], floors=()):
    d = kld[(kld.phase == "decode") & kld.arm.isin(arms)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    absent: dict[str, str] = {}
    series = {a: d[d.arm == a].groupby("step")["kld"].mean() for a in arms}
    _lines(ax, _positive(series, "KLD exactly 0 at every decode step", absent), floors, x_shift=1, log=True)
    ax.set_yscale("log")
    ax.set_xlabel("teacher-forced decode step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean KLD(golden ‖ arm)")
    ax.grid(alpha=.3, which="both")
    _legend_below(ax)
    fig.absent = absent
    return fig


@readable
def selection_margins(needle: pd.DataFrame, golden: str, arms: list[str]):
    """Golden's margin of the needle entry to the top-k boundary per trial vs prompt length,
    one panel per CSA layer; dashed: twice each arm's largest score shift (below it, that
    arm's perturbation could flip the pick)."""
    g = needle[(needle.arm == golden) & needle.golden_margin.notna()] if "golden_margin" in needle else needle
    layers = sorted(g.layer.unique()) if len(g) else []
    fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(4.8 * max(1, len(layers)), 3.8), squeeze=False)
    if not layers:
        axes[0, 0].text(.5, .5, "no needle entry outside the window", ha="center")
        return fig
    styles = arm_styles(arms)
    for ax, layer in zip(axes[0], layers):
        d = g[g.layer == layer]
        ax.scatter(d.length, d.golden_margin, s=14, color="k", label="golden margin (per prompt)")
        for a in arms:
            s = needle[(needle.arm == a) & (needle.layer == layer)].dscore_max
            if len(s) and s.notna().any():
                ax.axhline(2 * s.max(), ls="--", lw=1.2, color=styles[a]["color"], label=f"2 × max |Δscore| {a}")
        ax.axhline(0, color="grey", lw=.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"CSA layer {layer}")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("needle score − top-k boundary")
        ax.grid(alpha=.3)
    _legend_below(axes[0, 0])
    return fig
