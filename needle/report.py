"""The needle report, in the layout every report shares (infra.report_page, written by
infra.report_writer): tables as CSV, summary.json with schema_version, summary.md and a
self-contained index.html with the PNGs embedded, written to a temporary directory and
renamed into place, with a `latest` link beside it.

Plots (matplotlib, Agg): depth x length recall heatmap per arm (NIAH/RULER style), A-B
delta heatmap per arm pair with McNemar-significant cells marked, recall vs length with
Wilson intervals, outcome-taxonomy stacked bars, indexer in-top-k rate per CSA layer."""
from __future__ import annotations

import math
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter
from kernel_toggles import ToggleSet

from .scoring import OUTCOMES
from .tables import ALPHA, all_tables

OUTCOME_COLORS = {"correct": "#2ca02c", "partial": "#98df8a", "wrong": "#d62728",
                  "refused": "#ff9896", "other": "#9467bd", "empty": "#c5b0d5",
                  "truncated": "#ff7f0e", "server_error": "#7f7f7f"}


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:60] or "arm"


def _plt():
    import matplotlib.pyplot as plt      # lazy: a report without plots never loads matplotlib
    return plt


def _axes(cells):
    return sorted({c["length"] for c in cells}), sorted({c["depth"] for c in cells})


@dataclass(frozen=True)
class HeatScale:
    """How a heatmap colours and prints its cells, one per kind of map (recall, difference)."""
    cmap: str
    vmin: float
    vmax: float
    fmt: str = "{:.2f}"


RECALL_SCALE = HeatScale("RdYlGn", 0, 1)
DELTA_SCALE = HeatScale("RdBu_r", -1, 1, "{:+.2f}")


def _heatmap(plt, axes: tuple[list, list], m, title, scale: HeatScale, marks=None):
    """`axes`: (lengths, depths), as _axes gives them."""
    (Ls, Ds), cmap, vmin, vmax, fmt = axes, scale.cmap, scale.vmin, scale.vmax, scale.fmt
    fig, ax = plt.subplots(figsize=(1.1 + 0.85 * len(Ls), 1.0 + 0.55 * len(Ds)))
    cmap = plt.get_cmap(cmap).with_extremes(bad="#cfcfcf")   # no scored trial: grey, never a recall
    im = ax.imshow(np.ma.masked_invalid(np.array(m, dtype=float)), cmap=cmap, vmin=vmin, vmax=vmax,
                   aspect="auto", origin="upper")
    ax.set_xticks(range(len(Ls)), [str(x) for x in Ls], rotation=45)
    ax.set_yticks(range(len(Ds)), [f"{d:g}%" for d in Ds])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    for i in range(len(Ds)):
        for j in range(len(Ls)):
            v = m[i][j]
            if math.isnan(v):
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="#888")
            else:
                star = "*" if marks and marks[i][j] else ""
                r, g, b, _ = im.cmap(im.norm(v))          # dark cells get white text: readable on both ends
                ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
                text = "0" if v == 0 and scale is DELTA_SCALE else fmt.format(v)
                ax.text(j, i, text + star, ha="center", va="center", fontsize=8, color=ink,
                        fontweight="bold" if star else "normal")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def figures(t: dict, arms: list[str]):
    """(figure, file stem, title, caption) for each plot."""
    plt = _plt()
    yield from _heatmaps(plt, t, arms)
    yield _recall_vs_length(plt, t, arms)
    yield _outcomes(plt, t, arms)
    if t["mechanism"]:
        yield _mechanism(plt, t, arms)


def _heatmaps(plt, t: dict, arms: list[str]):
    """Recall per depth x length cell for each arm, then the paired difference to the first."""
    Ls, Ds = _axes(t["cells"])
    for a in arms:
        m = [[math.nan] * len(Ls) for _ in Ds]
        for c in t["cells"]:
            if c["arm"] == a and c["recall"] is not None:
                m[Ds.index(c["depth"])][Ls.index(c["length"])] = c["recall"]
        yield (_heatmap(plt, (Ls, Ds), m, f"recall: {a}", RECALL_SCALE), f"heatmap_{_slug(a)}",
               f"Recall, {a}", "Depth x context length; mean recall over the cell's scored trials "
               "(n/a: none scored, e.g. all truncated).")
    for b in arms[1:]:
        m = [[math.nan] * len(Ls) for _ in Ds]
        marks = [[False] * len(Ls) for _ in Ds]
        for p in t["pairs"]:
            if p["scope"] == "cell" and p["arm_b"] == b:
                i, j = Ds.index(p["depth"]), Ls.index(p["length"])
                m[i][j], marks[i][j] = p["delta"], p["significant"]
        yield (_heatmap(plt, (Ls, Ds), m, f"recall {arms[0]} - {b}  (* McNemar p<{ALPHA})", DELTA_SCALE,
                        marks), f"delta_{_slug(arms[0])}_vs_{_slug(b)}",
               f"{arms[0]} − {b}", f"Paired recall difference per cell (trials both arms scored): positive "
               f"where {arms[0]} recalls more, negative where {b} does; * = McNemar p < {ALPHA}, per cell, "
               "uncorrected.")


def _recall_vs_length(plt, t: dict, arms: list[str]):
    """Recall per length, one evenly spaced slot per length (383 and 384 tokens side by side,
    not stacked), each arm nudged sideways within its slot so intervals do not cover each
    other; the baseline dashed with hollow rings, so it never reads as hidden under another."""
    Ls, _ = _axes(t["cells"])
    from infra.plot_style import same_as
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    rows = {a: [r for r in t["lengths"] if r["arm"] == a and r["recall"] is not None] for a in arms}
    same = same_as({a: pd.Series([r["recall"] for r in rs], [r["length"] for r in rs])
                    for a, rs in rows.items() if rs})
    slot = {L: i for i, L in enumerate(sorted(Ls))}
    width = min(0.3, 0.12 * max(1, len(arms) - 1))
    for k, (a, rs) in enumerate(rows.items()):
        if rs:
            nudge = (k / (len(arms) - 1) - 0.5) * width if len(arms) > 1 else 0.0
            style = (dict(ls="--", color="k", mfc="none", ms=10, mew=1.4, zorder=3) if k == 0   # the baseline
                     else dict(ms=6, zorder=2))
            ax.errorbar([slot[r["length"]] + nudge for r in rs], [r["recall"] for r in rs],
                        yerr=[[max(0.0, r["recall"] - r["ci_low"]) for r in rs],
                              [max(0.0, r["ci_high"] - r["recall"]) for r in rs]],
                        marker="o", capsize=3, label=a + (f" ({same[a]})" if a in same else ""), **style)
    ax.set_xticks(range(len(slot)), [str(L) for L in slot], rotation=30 if len(slot) > 8 else 0)
    ax.set_xlim(-0.5, len(slot) - 0.5)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no scored trials", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens; one slot per length, evenly spaced)")
    ax.set_ylabel("recall (95% Wilson)")
    fig.tight_layout()
    return fig, "recall_vs_length", "Recall vs context length", (
        f"All depths pooled; 95% Wilson intervals; {arms[0]} (the baseline) dashed with hollow "
        "rings; one evenly spaced slot per length, the arms side by side within it.")


def _outcomes(plt, t: dict, arms: list[str]):
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms) + 1.5, 3.6), squeeze=False)
    for ax, a in zip(axes[0], arms):
        rs = [r for r in t["lengths"] if r["arm"] == a]
        bottom = [0.0] * len(rs)
        for o in OUTCOMES:
            h = [r[o] / r["n"] if r["n"] else 0 for r in rs]
            ax.bar(range(len(rs)), h, bottom=bottom, color=OUTCOME_COLORS[o], label=o)
            bottom = [x + v for x, v in zip(bottom, h)]
        ax.set_xticks(range(len(rs)), [str(r["length"]) for r in rs], rotation=45)
        ax.set_title(a, fontsize=9)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("fraction of trials")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    return fig, "outcomes", "Outcomes by length", ("Failure taxonomy: truncated (max_tokens) and "
                                                   "server errors are not recall misses.")


def _mechanism(plt, t: dict, arms: list[str]):
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    layers = sorted({m["layer"] for m in t["mechanism"]})
    w = 0.8 / max(1, len(arms))
    for k, a in enumerate(arms):
        ms = {m["layer"]: m for m in t["mechanism"] if m["arm"] == a}
        ax.bar([i + k * w for i, L in enumerate(layers) if L in ms],
               [ms[L]["in_topk_rate"] for L in layers if L in ms], width=w, label=a)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(layers))], [f"layer {L}" for L in layers])
    ax.set_ylim(0, 1)
    ax.set_ylabel("needle entry in indexer top-k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, "mechanism", "Mechanism (CSA layers)", (
        "Share of trials where a compressed entry holding the needle value was in the "
        "indexer's top-k at the question position (needle outside the window).")


ARM_COLUMNS = ["arm", "n", "n_scored", "recall", "ci_low", "ci_high", "correct", "partial", "wrong",
               "refused", "other", "empty", "truncated", "server_error", "exact_length_rate",
               "residual_max_abs", "latency_median_s", "retried_rows", "bos_replies", "bos_reasoning_only",
               "special_replies"]
COLUMNS = {
    "arms": ARM_COLUMNS,
    "kinds": ["arm", "kind", "values_per_trial", "n_scored", "recall", "ci_low", "ci_high", "all_found_rate",
              "correct", "partial", "wrong", "truncated", "server_error"],
    "lengths": ["arm", "length", "n_scored", "recall", "ci_low", "ci_high", "truncated", "server_error"],
    "residues": ["arm", "residue", "lengths", "n_scored", "recall", "ci_low", "ci_high", "truncated",
                 "server_error"],
    "window": ["arm", "window", "side", "distance_min", "distance_max", "n_scored", "recall", "ci_low",
               "ci_high"],
    "pairs": ["arm_a", "arm_b", "scope", "length", "depth", "n_pairs", "a_only", "b_only", "recall_a",
              "recall_b", "delta", "p_value", "test", "significant"],
    "mechanism": ["arm", "layer", "n", "in_topk_rate", "ci_low", "ci_high", "median_rank", "margin_median",
                  "topk", "all_values_in_topk_rate", "in_topk_rate_correct", "in_topk_rate_missed"],
    "mechanism_pairs": ["arm_a", "arm_b", "layer", "n", "picks_jaccard_mean", "identical_picks", "a_only",
                        "b_only", "p_value", "test", "margin_shift_median", "fragile_rate"],
    "cells": ["arm", "length", "depth", "n", "n_scored", "recall", "ci_low", "ci_high", "correct", "wrong",
              "truncated", "server_error"],
    "errors": ["arm", "error", "count"],
}

INTRO = ("Recall counts correct (1) and partial (found fraction) over scored trials; truncated "
         "(finish_reason length) and server errors are reported beside it, never as misses. "
         "Intervals: 95% Wilson. Pairs: the first arm against each other one on identical "
         "prompts, McNemar (exact binomial below 25 discordant pairs).")


def _frame(rows: list[dict], key: str) -> pd.DataFrame:
    cols = COLUMNS[key]
    return pd.DataFrame(rows, columns=cols) if rows else pd.DataFrame(columns=cols)


def _ci(r: dict) -> str:
    """Recall and its interval as the arms table prints them (3 significant digits), so the
    verdict's numbers are the table's."""
    return f"{r['recall']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}]"


def verdict(t: dict, arms: list[str]) -> list[str]:
    """The recall finding in words: each arm's recall, then each arm against the baseline
    overall and where (by length) the paired test says they differ."""
    by_arm = {a["arm"]: a for a in t["arms"]}
    if not arms:
        return ["No trials."]
    base = arms[0]
    out = []
    b = by_arm[base]
    if b["recall"] is not None:
        trend = ", ".join(f"{r['recall']:.3g} at {r['length']}" for r in t["lengths"]
                          if r["arm"] == base and r["recall"] is not None)
        out.append(f"`{base}` recall {_ci(b)} over {b['n_scored']} scored trials ({trend}).")
    for a in arms[1:]:
        r = by_arm[a]
        if r["recall"] is None:
            out.append(f"`{a}`: no scored trials.")
            continue
        overall = next((p for p in t["pairs"] if p["arm_b"] == a and p["scope"] == "all"), None)
        line = f"`{a}` recall {_ci(r)}"
        if overall and overall["n_pairs"]:
            disc = overall["a_only"] + overall["b_only"]
            sig = "significantly different" if overall["significant"] else "no significant difference"
            line += (f"; {base} − {a} = {overall['delta']:+.3g} over {overall['n_pairs']} paired trials "
                     f"({disc} discordant, McNemar p = {overall['p_value']:.3g}): {sig}")
        worse = [p for p in t["pairs"] if p["arm_b"] == a and p["scope"] == "length" and p["significant"]]
        if worse:
            line += "; differs at " + ", ".join(f"{p['length']} tokens ({p['delta']:+.3g}, p = {p['p_value']:.3g})"
                                                for p in worse)
        out.append(line + ".")
    out = _bos_lines(t["arms"]) + out        # a finding whatever the recall: said first
    out += _mechanism_lines(t, base)
    lost = [a for a in t["arms"] if a["truncated"] or a["server_error"]]
    if lost:
        out.append("Not scored (never counted as misses): " + "; ".join(
            f"`{a['arm']}` {a['truncated']} truncated, {a['server_error']} server errors" for a in lost) + ".")
    return out


def _bos_lines(arms: list[dict]) -> list[str]:
    """Each arm whose replies carry BOS: token 0, what argmax over a NaN logits row emits
    (a finding whatever its recall: a sound server never writes it into a reply)."""
    return [f"`{a['arm']}`: BOS (token 0, what argmax over a NaN logits row emits) in {a['bos_replies']} of "
            f"{a['n']} replies ({a['bos_reasoning_only']} of them only in reasoning_content, which a scan of "
            "content alone misses)." for a in arms if a.get("bos_replies")]


def _mechanism_lines(t: dict, base: str) -> list[str]:
    """Each arm's needle-entry losses against the baseline, pooled over trials x CSA layers
    (one layer alone when there is one), where the arms differ at all."""
    out = []
    rows = t.get("mechanism_pairs") or []
    for r in rows:
        has_pooled = any(x["arm_b"] == r["arm_b"] and x["layer"] == "all" for x in rows)
        pooled = r["layer"] == "all" or not has_pooled
        if not pooled or r["a_only"] + r["b_only"] == 0:
            continue
        where = "trial × CSA layer pairs" if r["layer"] == "all" else f"trials at CSA layer {r['layer']}"
        out.append(f"Mechanism: `{r['arm_b']}` loses the needle's indexer entry in {r['a_only']} of "
                   f"{r['n']} {where} where `{base}` keeps it ({r['b_only']} the other way, McNemar "
                   f"p = {r['p_value']:.2g}); picks identical in {r['identical_picks']} of {r['n']}.")
    return out


def _informative(pairs: pd.DataFrame) -> pd.Series:
    """Pairs with something to say: overall / per-length rows, or a cell with a discordant pair."""
    if pairs.empty:
        return pd.Series(dtype=bool)
    return (pairs.scope != "cell") | ((pairs.a_only + pairs.b_only) > 0)


def _suspects(pairs: pd.DataFrame) -> pd.DataFrame:
    """Where the arms disagree most: rows with discordant pairs, smallest p first."""
    if pairs.empty:
        return pairs
    d = pairs[(pairs.a_only + pairs.b_only) > 0]
    return d.sort_values(["p_value", "scope"]).head(8).reset_index(drop=True)


def _same_arm(label: str, toggles: str) -> bool:
    """Whether an arm label (`engine`, `golden`, ...) names exactly these toggles, so the
    suggested command can use the short name."""
    try:
        return set(ToggleSet.parse(label).names) == set(ToggleSet.parse(toggles).names)
    except (ValueError, KeyError):
        return False


def _next_steps(meta: dict, t: dict) -> list[str]:
    arms = meta.get("trials", {}).get("arms") if isinstance(meta.get("trials"), dict) else None
    specs = []
    for a in meta.get("arms") or arms or []:
        if a.get("kind") == "inprocess":
            spec = a["name"] if _same_arm(a["name"], str(a["arm"])) else str(a["arm"])
            specs.append(f"--arm {a['name']}={shlex.quote(spec)}")
        elif a.get("url"):
            specs.append(f"--endpoint {a['name']}={a['url']}")
    lengths = sorted({r["length"] for r in t["lengths"]})
    longer = lengths + [2 * lengths[-1]] if lengths else []
    cmd = " ".join(["fidelity needle", *specs, "--lengths", ",".join(map(str, longer)),
                    "--reps", str(2 * int(meta.get("reps") or 1))])
    return [cmd + "   # more trials per cell and one longer context: power for the difference"]


def build_page(t: dict, arms: list[str], meta: dict, figures: list[str]) -> Page:
    lengths = sorted({r["length"] for r in t["lengths"]})
    depths = sorted({c["depth"] for c in t["cells"]})
    n = {a["arm"]: a["n"] for a in t["arms"]}
    kinds = sorted({k["kind"] for k in t["kinds"]})
    compared = (f"{', '.join(f'`{a}`' for a in arms)} on {max(n.values()) if n else 0} "
                f"{'/'.join(kinds)} trials each: "
                f"lengths {', '.join(map(str, lengths))} tokens × depths "
                f"{', '.join(f'{d:g}' for d in depths)}%"
                + (f" × {meta['reps']} rep(s)" if meta.get("reps") else "") + ".")
    pairs = _frame(t["pairs"], "pairs")
    keep = _informative(pairs)
    sus = _suspects(pairs)
    lead = ["recall_vs_length"] + [f for f in figures if f.startswith("delta_")][:1]
    sections = [
        Section("Arms", INTRO, [Table(_frame(t["arms"], "arms"), fold=False)], ["outcomes"]),
        Section("Recall by kind", "Recall is the found fraction of the expected values (RULER's "
                "string match); all_found_rate the share of trials with every value found.",
                [Table(_frame(t["kinds"], "kinds"), fold=False)]),
        Section("Recall by length (all depths)", "", [Table(_frame(t["lengths"], "lengths"))],
                [f for f in figures if f.startswith("heatmap_")]),
        Section("Recall by length residue", "Per arm and prompt length mod 4 (V4's ratio-4 compressor "
                "groups; `--lengths boundaries` covers every residue): a bug of one residue "
                "(vllm #55927: lengths 3 mod 4) shows in its own row. Then recall with the needle "
                "inside vs outside the last query's sliding window (measured token distance from "
                "the needle value to the prompt's end; in-process arms only).",
                [Table(_frame(t["residues"], "residues"))]
                + ([Table(_frame(t["window"], "window"))] if t.get("window") else [])),
        Section("Paired comparison (McNemar)", "Overall and per length, then every cell with a "
                "discordant pair; cells where both arms agree on every trial are folded below.",
                [Table(pairs[keep].reset_index(drop=True), fold=False),
                 Table(pairs[~keep].reset_index(drop=True), fold=True,
                       summary=f"{int((~keep).sum())} cells with no discordant pair (nothing to test)")],
                [f for f in figures if f.startswith("delta_")][1:]),
        Section("Mechanism: indexer top-k at the question position",
                "Share of trials whose needle entry was in the indexer's top-k, per CSA layer "
                "(in-process arms only).", [Table(_frame(t["mechanism"], "mechanism"))], ["mechanism"]),
        Section("Mechanism, paired: indexer picks vs the first arm", "McNemar on the needle "
                "entry kept, per CSA layer and pooled; margin_shift_median: the arm's typical shift "
                "of the needle entry's margin to the top-k boundary; fragile_rate: share of the first "
                "arm's needle entries within twice that shift of the boundary.",
                [Table(_frame(t["mechanism_pairs"], "mechanism_pairs"))]),
        Section("Cells", "", [Table(_frame(t["cells"], "cells"), fold=True,
                                     summary=f"{len(t['cells'])} cells (arm × length × depth)")]),
        Section("Server errors", "", [Table(_frame(t["errors"], "errors"))]),
    ]
    return Page("Needle-in-a-haystack recall", compared, verdict(t, arms), lead,
                Table(sus, caption="Where the arms disagree: rows with discordant trials, smallest p first.",
                      fold=False) if len(sus) else None,
                _next_steps(meta, t), sections, meta)


def write_report(rows: list[dict], root: str | Path, meta: dict | None = None,
                 run_id: str | None = None, with_plots: bool = True) -> Path:
    """Write the report for `rows` (latest row per arm and trial, baseline arm first) to
    root/<run_id> and point root/latest at it; returns the report directory."""
    meta = dict(meta or {})
    b = meta.get("boundaries") or {}
    return _write(all_tables(rows, (b.get("ratios") or [4])[0], b.get("window")), root, meta, run_id,
                  with_plots and bool(rows))


def rerender(report: str | Path, root: str | Path, run_id: str) -> Path:
    """A saved report written again from its summary.json (its tables and meta) by this
    checkout's page code, to root/<run_id>: a committed page whose trials took hours (mlx-vlm
    at 8K tokens) follows the page's wording without rerunning them."""
    import json
    s = json.loads((Path(report) / "summary.json").read_text())
    return _write(s["tables"], root, s["meta"], run_id, True)


def _write(t: dict, root, meta: dict, run_id: str | None, with_plots: bool) -> Path:
    arms = [a["arm"] for a in t["arms"]]
    w = ReportWriter(root, run_id or time.strftime("needle-%Y%m%d-%H%M%S"))
    try:
        for key, tab in t.items():
            w.table(key, pd.DataFrame(tab) if tab else pd.DataFrame(columns=COLUMNS.get(key, [])))
        w.json("summary", {"meta": meta, "tables": t})
        stems = []
        if with_plots:
            import matplotlib.pyplot as plt
            for fig, stem, title, cap in figures(t, arms):
                w.figure(fig, stem, title, cap)
                stems.append(stem)
                plt.close(fig)
        w.page(build_page(t, arms, meta, stems))
        return w.commit()
    except BaseException:
        w.abort()
        raise
