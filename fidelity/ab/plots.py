"""Plots of an A/B run: drift vs layer with the noise-floor band, toggle × layer heatmap,
attribution bars with CIs, KLD distribution per arm, indexer top-k recall vs context
position, decode-step drift (the signals board is fidelity.verdict.board). No backend is
forced here: the CLI selects Agg, a notebook keeps its inline one."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def _legend_below(ax):
    """Legend under the axes in columns, so the plot keeps the page's width."""
    n = len(ax.get_legend_handles_labels()[1])
    if n:
        ax.legend(fontsize=8, ncol=min(4, max(1, (n + 5) // 6)), loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), frameon=False)


def drift_vs_layer(drift: pd.DataFrame, floor_arm: str, arms: list[str], tap="out", phase="prefill"):
    d = drift[(drift.tap == tap) & (drift.phase == phase) & (drift.bucket == "all")]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    fl = d[d.arm == floor_arm].groupby("layer")["rel_l2"]
    if len(fl):
        lo, hi, mid = fl.min(), fl.max(), fl.mean()
        ax.fill_between(lo.index, lo.values, hi.values, color="0.85", label=f"{floor_arm} (min–max)")
        ax.plot(mid.index, mid.values, color="0.5", ls="--", lw=1)
    cmap = plt.get_cmap("tab20")
    for j, a in enumerate(x for x in arms if x != floor_arm):
        s = d[d.arm == a].groupby("layer")["rel_l2"].mean().replace(0, np.nan)
        if s.notna().any():
            ax.plot(s.index, s.values, marker="o", ms=3, lw=1.3, color=cmap(j % 20), label=a)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(f"relative L2 of `{tap}` vs golden")
    ax.grid(alpha=.3, which="both")
    _legend_below(ax)
    return fig


def toggle_layer_heatmap(drift: pd.DataFrame, arms: list[str], tap="out", phase="prefill"):
    d = drift[(drift.tap == tap) & (drift.phase == phase) & (drift.bucket == "all") & drift.arm.isin(arms)]
    piv = d.groupby(["arm", "layer"])["rel_l2"].mean().unstack("layer").reindex(arms)
    z = np.log10(piv.to_numpy(dtype=float).clip(1e-12))
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * max(1, piv.shape[1]), 0.9 + 0.32 * len(arms)))
    im = ax.imshow(z, aspect="auto", cmap="magma")
    ax.set_yticks(range(len(arms)), arms, fontsize=8)
    ax.set_xticks(range(piv.shape[1]), [str(c) for c in piv.columns])
    ax.set_xlabel("layer")
    fig.colorbar(im, ax=ax, label=f"log10 rel L2 of `{tap}`")
    return fig


def attribution_bars(attr: pd.DataFrame, floor_hi: float):
    methods = [m for m in ("shapley", "one_at_a_time", "leave_one_out") if m in set(attr.method)]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 0.8 + 0.33 * attr.toggle.nunique()),
                             squeeze=False, sharey=False)
    for ax, m in zip(axes[0], methods):
        a = attr[attr.method == m].sort_values("value")
        y = np.arange(len(a))
        err = np.vstack([a.value - a.lo, a.hi - a.value]).clip(0)
        ax.barh(y, a.value, xerr=err, color=np.where(a.lo > floor_hi, "#d62728", "#7f7f7f"),
                capsize=2)
        ax.axvline(floor_hi, color="k", ls="--", lw=1, label="noise floor")
        ax.set_yticks(y, a.toggle, fontsize=8)
        ax.set_title(m.replace("_", "-"))
        ax.set_xlabel("Δ mean final-logit KLD")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def kld_distribution(kld: pd.DataFrame, arms: list[str], phase="prefill"):
    d = kld[(kld.phase == phase) & kld.arm.isin(arms)]
    data = [np.log10(d[d.arm == a].kld.to_numpy().clip(1e-12)) for a in arms]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.33 * len(arms)))
    ax.boxplot(data, orientation="horizontal", whis=(1, 99), showfliers=False)
    ax.set_yticks(range(1, len(arms) + 1), arms, fontsize=8)
    ax.set_xlabel("log10 KLD(golden ‖ arm) per position (box: quartiles, whiskers: p1–p99)")
    ax.grid(alpha=.3, axis="x")
    return fig


def topk_recall_vs_position(drift: pd.DataFrame, arms: list[str]):
    d = drift[(drift.tap == "attn.index.topk") & (drift.phase == "prefill") & (drift.bucket != "all")
              & drift.arm.isin(arms)]
    fig, ax = plt.subplots(figsize=(9, 4))
    if d.empty:
        ax.text(.5, .5, "no CSA layer captured", ha="center")
        return fig
    d = d.assign(start=d.bucket.str.split("-").str[0].astype(int))
    for a in arms:
        s = d[d.arm == a].groupby("start")["recall"].mean()
        if len(s):
            ax.plot(s.index + 1, s.values, marker="o", ms=3, label=a)
    ax.set_xscale("log")
    ax.set_xlabel("context position (bucket start + 1)")
    ax.set_ylabel("indexer top-k recall vs golden (mean over CSA layers)")
    ax.grid(alpha=.3)
    _legend_below(ax)
    return fig


def decode_drift(kld: pd.DataFrame, arms: list[str]):
    d = kld[(kld.phase == "decode") & kld.arm.isin(arms)]
    fig, ax = plt.subplots(figsize=(9, 4))
    for a in arms:
        s = d[d.arm == a].groupby("step")["kld"].mean().replace(0, np.nan)
        if s.notna().any():
            ax.plot(s.index + 1, s.values, marker="o", ms=3, label=a)
    ax.set_yscale("log")
    ax.set_xlabel("teacher-forced decode step")
    ax.set_ylabel("mean KLD(golden ‖ arm)")
    ax.grid(alpha=.3, which="both")
    _legend_below(ax)
    return fig


def selection_margins(needle: pd.DataFrame, golden: str, arms: list[str]):
    """Golden's margin of the needle entry to the top-k boundary per trial vs prompt length,
    one panel per CSA layer; dashed: twice each arm's largest score shift (below it, that
    arm's perturbation could flip the pick)."""
    g = needle[(needle.arm == golden) & needle.golden_margin.notna()] if "golden_margin" in needle else needle
    layers = sorted(g.layer.unique()) if len(g) else []
    fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(4.5 * max(1, len(layers)), 3.6), squeeze=False)
    if not layers:
        axes[0, 0].text(.5, .5, "no needle entry outside the window", ha="center")
        return fig
    for ax, layer in zip(axes[0], layers):
        d = g[g.layer == layer]
        ax.scatter(d.length, d.golden_margin, s=14, color="k", label="golden margin (per prompt)")
        for a in arms:
            s = needle[(needle.arm == a) & (needle.layer == layer)].dscore_max
            if len(s) and s.notna().any():
                ax.axhline(2 * s.max(), ls="--", lw=1, label=f"2 × max |Δscore| {a}")
        ax.axhline(0, color="grey", lw=.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"CSA layer {layer}")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("needle score − top-k boundary")
        ax.grid(alpha=.3)
    _legend_below(axes[0, 0])
    return fig
