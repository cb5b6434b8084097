"""The consistency report's plots, each from the conditions' real coordinates: prefix-cache
hits at their shared length (full hit, multi-turn and eviction on their own panel), the
batch family against requests in flight, KL along a chunked prompt with its boundaries,
and KL along long generations beside the engine's re-read of the same tokens."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.plot_style import arm_styles, readable, same_as

from .judge import JUMP, is_floor
from .longgen import ROLLING, drift_start, rolling_mean

KL_FLOOR_PLOT = 1e-9          # zero KL drawn here on the log axis


def floors_mask(table: pd.DataFrame) -> np.ndarray:
    """Which rows are floors (cold-again, alone-again, before@b, mode:floor): not judged."""
    return np.array([is_floor(f, c) for f, c in zip(table.family, table.condition)], bool)


@readable
def prefix_figure(table: pd.DataFrame):
    """KL over the generated tokens per arm, from each condition's own coordinates: the `hit@P`
    conditions against the shared prefix length P (left; the boundary classes as labelled
    vertical lines), the conditions that have no prefix length -- a full hit, a second chat
    turn, the prompt after eviction pressure -- each at its own place on the right, never
    joined by a line. Flagged conditions filled, the others hollow; an arm hidden under
    another's curve says so in the legend. `fig.drawn`: (arm, condition) -> panel index."""
    pre = table[(table.family == "prefix").to_numpy() & ~floors_mask(table)]
    if pre.empty:
        return None
    hits = pre[pre.condition.str.startswith("hit@")]
    other = pre[~pre.condition.str.startswith("hit@")]
    arms = list(dict.fromkeys(pre.arm))
    styles = arm_styles(arms)
    widths = [3, 1] if len(hits) and len(other) else [1]
    fig, axes = plt.subplots(1, len(widths), figsize=(10, 3.8), sharey=True, squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    axes = list(axes[0])
    fig.drawn = {}
    # the KL the headline, the verdict and Suspects quote: over the generated tokens
    y_of = lambda g: np.maximum(g.kl_max.to_numpy(float), KL_FLOOR_PLOT)      # noqa: E731
    if len(hits):
        ax = axes[0]
        series = {a: pd.Series(y_of(g.sort_values("shared")), index=g.sort_values("shared").shared.to_numpy())
                  for a, g in hits.groupby("arm", sort=False)}
        hidden = same_as(series, log=True)
        for arm, g in hits.groupby("arm", sort=False):
            g = g.sort_values("shared")
            st = styles[arm]
            y, f = y_of(g), g.flagged.to_numpy(bool)
            x = g.shared.to_numpy(float)
            label = arm + (f" ({hidden[arm]})" if arm in hidden else "")
            ax.plot(x, y, ls=st["ls"], color=st["color"], lw=1.2, alpha=0.6, label=label, zorder=2)
            ax.plot(x[f], y[f], st["marker"], color=st["color"], ms=6, zorder=4)
            ax.plot(x[~f], y[~f], st["marker"], color=st["color"], mfc="white", ms=6, zorder=4)
            if arm in hidden:
                ax.plot(x, y, "o", ms=12, mfc="none", color=st["color"], lw=0, zorder=1)
            fig.drawn.update({(arm, c): 0 for c in g.condition})
        for cls, g in hits.groupby("class"):
            b = int(g.shared.median())
            ax.axvline(b, color="0.8", lw=0.8, zorder=0)
            ax.annotate(cls, (b, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=8, color="0.4")
        ax.set_xlabel("shared prefix (tokens) before the prompt is asked")
        ax.set_title("Prefix hits (hit@P)")
        ax.legend(fontsize=8, loc="center left")
    if len(other):
        ax = axes[-1]
        places = list(dict.fromkeys(other.condition))
        off = (np.arange(len(arms)) - (len(arms) - 1) / 2) * (0.5 / max(len(arms), 1))
        for i, arm in enumerate(arms):
            g = other[other.arm == arm]
            if g.empty:
                continue
            st = styles[arm]
            x = np.array([places.index(c) for c in g.condition], float) + off[i]
            y, f = y_of(g), g.flagged.to_numpy(bool)
            ax.plot(x[f], y[f], st["marker"], color=st["color"], ms=7, ls="none", zorder=4,
                    label=None if len(hits) else arm)
            ax.plot(x[~f], y[~f], st["marker"], color=st["color"], mfc="white", ms=7, ls="none", zorder=4)
            fig.drawn.update({(arm, c): len(axes) - 1 for c in g.condition})
        ax.set_xticks(range(len(places)), places)
        ax.set_xlim(-0.6, len(places) - 0.4)
        ax.set_title("No prefix length")
        if not len(hits):
            ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL over the generated tokens\n(max over probes)")
    fig.suptitle(f"Prefix-cache hit vs cold (filled: flagged; hollow: not; {KL_FLOOR_PLOT:g} = bit-identical)",
                 fontsize=11)
    fig.tight_layout()
    return fig


def _batch_figure(table: pd.DataFrame):
    """First-token KL and the share of bit-identical replies vs the requests in flight."""
    b = table[(table.family == "batch") & (table["class"] == "concurrency")]
    if b.empty:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, g in b.groupby("arm", sort=False):
        g = g.sort_values("shared")
        y = np.maximum(g.kl_max.to_numpy(float), KL_FLOOR_PLOT)
        line, = ax.plot(g.shared, y, "-o", label=arm)
        bx.plot(g.shared, g.bitwise / g.probes, "-o", color=line.get_color(), label=arm)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("other requests in flight")
    ax.set_yscale("log")
    ax.set_ylabel("KL over the generated tokens (max)")
    bx.set_ylabel("replies bit-identical to alone")
    bx.set_ylim(-0.05, 1.05)
    ax.set_title(f"Alone vs in company ({KL_FLOOR_PLOT:g} = identical)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _chunk_figure(probes: pd.DataFrame):
    """KL per prompt position against the reference (median over probes, per arm), the
    prefill chunk boundaries marked."""
    if probes.empty or "kl" not in probes:
        return None
    prof = probes[(probes.family == "chunk") & (probes.condition == "profile")]
    if prof.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for arm, g in prof.groupby("arm", sort=False):
        kl = np.median(np.vstack([np.asarray(k, float) for k in g.kl]), 0)
        ax.plot(np.arange(len(kl)), np.maximum(kl, KL_FLOOR_PLOT), lw=0.9, label=arm)
    c, n = int(prof.chunk.iloc[0]), max(len(k) for k in prof.kl)
    for b in range(c, n, c):
        ax.axvline(b, color="0.5", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel(f"prompt position (dashed: prefill chunk boundaries, every {c} tokens)")
    ax.set_ylabel("KL vs reference (median)")
    ax.set_title(f"Per-position KL against the one-piece reference ({KL_FLOOR_PLOT:g} = identical)",
                 fontsize=10)
    ax.legend(fontsize=8)
    return fig


def _drift_figure(table: pd.DataFrame, probes: pd.DataFrame):
    """Rolling KL against the reference along each long generation (one line per
    generation, per-arm colour) and, thin, along the engine's re-read of the same tokens
    (the floor); where drift starts marked only on runs the judgement flagged for drift
    (a stretch flagged in `table`), as the longgen table dates it."""
    if probes.empty or "kl_floor" not in probes:
        return None
    lg = table[(table.family == "longgen") & table.flagged]
    drifted = {(a, c.split(":", 1)[0]) for a, c in zip(lg.arm, lg.condition)}
    b = probes[(probes.family == "longgen") & probes.condition.str.endswith(":behaviour")]
    if b.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.4))
    colours = {}
    for _, r in b.iterrows():
        kl, floor = np.asarray(r.kl, float), np.asarray(r.kl_floor, float)
        w = min(ROLLING, len(kl))
        if not w:
            continue
        x = np.arange(len(kl) - w + 1) + w - 1
        label = f"{r.arm} ({r['mode']})"
        c = colours.get(label)
        line, = ax.plot(x, np.maximum(rolling_mean(kl, w), KL_FLOOR_PLOT), lw=0.9, color=c,
                        ls="-" if r["mode"] == "greedy" else "--", label=None if c else label)
        colours[label] = line.get_color()
        ax.plot(x, np.maximum(rolling_mean(floor, w), KL_FLOOR_PLOT), lw=0.5, alpha=0.5, color=line.get_color(),
                ls="-" if r["mode"] == "greedy" else "--")
        start = drift_start(kl, floor, ROLLING, JUMP) if (r.arm, r["mode"]) in drifted else None
        if start is not None:
            ax.axvline(start, color=line.get_color(), ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("generated token (dotted: where drift starts)")
    ax.set_ylabel(f"KL vs reference (rolling mean, {ROLLING})")
    ax.set_title(f"Along the engine's own long output (thick) and its re-read (thin), teacher-forced "
                 f"({KL_FLOOR_PLOT:g} = identical)", fontsize=10)
    ax.legend(fontsize=8)
    return fig


# stem -> (draw(conditions, probes), title)
def spec_figure(probes: pd.DataFrame):
    """Speculation on vs off, one panel per arm: KL per generated step of the greedy reply
    against the baseline's (each probe a line; the baseline asked again dashed grey, its
    floor), the first step whose distribution differs (circle) and whose token differs
    (triangle), tokens that are not their own step's top-1 (red cross) and special tokens
    injected (star): where a verifier's mistake shows, and which kind."""
    if probes.empty or "family" not in probes:
        return None
    g = probes[(probes.family == "spec") & (probes.condition == "greedy")]
    if g.empty:
        return None
    arms = list(dict.fromkeys(g.arm))
    fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms) + 1.2, 3.4), sharey=True, squeeze=False)
    for ax, arm in zip(axes[0], arms):
        for i, r in enumerate(g[g.arm == arm].itertuples(index=False)):
            kl = np.maximum(np.asarray(r.kl, float), KL_FLOOR_PLOT)
            c = f"C{i % 10}"
            ax.plot(np.arange(len(kl)), kl, lw=0.9, color=c, label=f"probe {r.probe}")
            for step, marker, size in ((r.first_lp_diff, "o", 36), (r.first_diff, "^", 44)):
                if step is not None and not pd.isna(step) and int(step) < len(kl):
                    ax.scatter([int(step)], [kl[int(step)]], marker=marker, s=size, facecolors="none",
                               edgecolors=c, zorder=3)
            for steps, marker, color in ((r.off_top1, "x", "C3"), (r.injected, "*", "k")):
                ok = [int(x) for x in (steps or []) if int(x) < len(kl)]
                if ok:
                    ax.scatter(ok, kl[ok], marker=marker, s=48, color=color, zorder=4)
        fl = float(g[g.arm == arm].floor_kl_max.max())
        ax.axhline(max(fl, KL_FLOOR_PLOT), color="0.5", ls="--", lw=0.9)
        ax.set_yscale("log")
        ax.set_title(f"{arm} vs {g[g.arm == arm].baseline.iloc[0]}", fontsize=9)
        ax.set_xlabel("generated step")
    top = max([max(list(k) + [0.0]) for k in g.kl] + [float(g.floor_kl_max.max())])
    axes[0][0].set_ylim(KL_FLOOR_PLOT / 3, max(3 * top, 1e-6))     # a lossless arm: a flat line at the bottom
    axes[0][0].set_ylabel(f"KL vs baseline ({KL_FLOOR_PLOT:g} = identical)")
    from matplotlib.lines import Line2D
    keys = [Line2D([], [], color="0.5", ls="--", label="baseline asked again (floor)"),
            Line2D([], [], marker="o", ls="", mfc="none", color="0.3", label="first distribution difference"),
            Line2D([], [], marker="^", ls="", mfc="none", color="0.3", label="first token difference"),
            Line2D([], [], marker="x", ls="", color="C3", label="token not its step's top-1"),
            Line2D([], [], marker="*", ls="", color="k", label="special token injected")]
    axes[0][-1].legend(handles=keys, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


FIGURES = {"prefix_kl": (lambda t, p: prefix_figure(t), "Prefix-cache hits vs cold"),
           "spec_kl": (lambda t, p: spec_figure(p), "Speculation on vs off, step by step"),
           "batch_kl": (lambda t, p: _batch_figure(t), "Alone vs with other requests in flight"),
           "chunk_kl": (lambda t, p: _chunk_figure(p), "KL along the prompt, chunk boundaries marked"),
           "drift": (_drift_figure, "KL along long generations")}
