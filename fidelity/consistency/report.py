"""The `fidelity consistency` report, in the house format: the verdict (which condition
changes which arm's answer), one section per probe family with its table and plot, every
probe as a tidy CSV, and how the run was made (cold starts, sizes the servers report,
requests, retries)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from .judge import JUMP
from .longgen import ROLLING, drift_start, rolling_mean

KL_FLOOR_PLOT = 1e-9          # zero KL drawn here on the log axis


def _prefix_figure(table: pd.DataFrame):
    """First-token KL vs the shared prefix length, per arm; flagged conditions filled,
    the others hollow; the boundary classes as labelled vertical lines."""
    hits = table[(table.family == "prefix") & table.shared.notna() & (table["class"] != "full")]
    if hits.empty:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for arm, g in hits.groupby("arm", sort=False):
        g = g.sort_values("shared")
        y = np.maximum(g.kl_first_max.to_numpy(float), KL_FLOOR_PLOT)
        line, = ax.plot(g.shared, y, "-", alpha=0.5, label=arm)
        f = g.flagged.to_numpy(bool)
        ax.plot(g.shared[f], y[f], "o", color=line.get_color())
        ax.plot(g.shared[~f], y[~f], "o", mfc="none", color=line.get_color())
    for cls, g in hits.groupby("class"):
        b = int(g.shared.median())
        ax.axvline(b, color="0.8", lw=0.8, zorder=0)
        ax.annotate(cls, (b, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                    ha="right", fontsize=7, color="0.4")
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix (tokens) before the prompt is asked")
    ax.set_ylabel("KL at first generated token (max over probes)")
    ax.set_title(f"Prefix-cache hit vs cold (filled: flagged; {KL_FLOOR_PLOT:g} = bit-identical)")
    ax.legend(fontsize=8)
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
FIGURES = {"prefix_kl": (lambda t, p: _prefix_figure(t), "Prefix-cache hits vs cold"),
           "batch_kl": (lambda t, p: _batch_figure(t), "Alone vs with other requests in flight"),
           "chunk_kl": (lambda t, p: _chunk_figure(p), "KL along the prompt, chunk boundaries marked"),
           "drift": (_drift_figure, "KL along long generations")}


def _sections(table: pd.DataFrame, behaviour: pd.DataFrame) -> list[Section]:
    out = []
    if (table.family == "prefix").any():
        out.append(Section(
            "Prefix cache: a hit vs the same prompt cold",
            "Each condition asks a probe prompt after the cache was warmed by another prompt "
            "sharing its first `shared` tokens (`hit@P`), or by the prompt itself (`full-hit`); "
            "the reply is compared with the prompt asked cold. `cold-again` is the floor: cold "
            "asked twice. `cached_median` is the engine's own count of prompt tokens taken from "
            "its cache (the proof a hit happened; a page-granular cache restores the largest page "
            "multiple below the shared prefix). `why` says the rule that flagged it "
            "(fidelity/consistency/judge.py).",
            [Table(table[table.family == "prefix"].drop(columns=["family", "distinct"]), fold=False)]))
    if (table.family == "batch").any():
        out.append(Section(
            "Batch: alone vs with other requests in flight",
            "Each probe prompt is scored (prompt logprobs and a greedy continuation) alone, "
            "alone again (the floor), and `repeats` times while `shared` filler requests of mixed "
            "lengths are generating beside it (`batch@k`). `distinct`: distinct greedy "
            "completions among a probe's repeats. Prompt-logprob requests skip the engines' "
            "prefix caches, so repeats are not cache hits.",
            [Table(table[table.family == "batch"].drop(columns=["family", "cached_median"]), fold=False)],
            ["batch_kl"]))
    if (table.family == "chunk").any():
        out.append(Section(
            "Chunked prefill: KL jumps at the chunk boundary",
            "Each probe prompt (straddling the engine's prefill chunk) is scored by the endpoint "
            "and by the reference in one piece; `before` is the window of positions just before "
            "the first boundary (the floor), `after@b` the window just after boundary b. "
            "`diverged`: windows where the top-1 token differs from the reference somewhere. An "
            "arm that differs from the reference evenly (a kernel's numerics) is not flagged; one "
            "whose KL jumps where the prefill is cut is.",
            [Table(table[table.family == "chunk"].drop(columns=["family", "cached_median", "distinct"]),
                   fold=False)], ["chunk_kl"]))
    if (table.family == "longgen").any():
        out.append(Section(
            "Long generations: where the engine leaves the reference along its own output",
            "Each probe prompt is generated to the token cap, greedily and sampled; the engine is "
            "then asked the same tokens again as one prompt (a re-read in one prefill, none of the "
            "state the decode built), and the reference computed here scores both teacher-forced "
            "(KL against what the engine reported, before each token). `floor` is the re-read; each "
            "stretch `steps@a` (from step 0) is flagged when its KL is above the re-read's at the "
            "same positions (Wilcoxon signed-rank, p < 0.05, at least 4x in the mean). The second "
            "table is the one judgement per arm and run, read by the verdict: flagged for a "
            "flagged stretch, or for a misbehaviour (loops: a tail with under 30% distinct 8-grams; "
            "thinking until the cap; special tokens in the text; early EOS) more frequent than in "
            "the first arm's same run (one-sided Fisher exact test, p < 0.05).",
            [Table(table[table.family == "longgen"].drop(columns=["family", "cached_median", "distinct",
                                                                   "diverged", "first_step"]), fold=False),
             Table(behaviour, fold=False)], ["drift"]))
    return out


def _plan_words(family: str, plan: dict) -> str:
    if family == "longgen":
        return (f"longgen: {plan['probes']} chat tasks (thinking {'on' if plan['thinking'] else 'off'}) "
                f"to {plan['max_tokens']} tokens, greedy" + (f" and sampled at T={plan['temperature']:g}"
                                                              if plan["temperature"] > 0 else ""))
    length = plan.get("length") or "1.5 chunks of"
    return f"{family}: {plan['probes']} probe prompts of {length} tokens"


def build_page(result: dict) -> Page:
    m, table = result["manifest"], result["conditions"]
    arms = ", ".join(f"`{a['name']}` ({a['dialect']}, model {a['model']})" for a in m["arms"])
    fams = m["settings"]["families"]
    plans = "; ".join(_plan_words(f, m["settings"][f]) for f in fams)
    compared = f"Arms {arms} on {m['checkpoint']}'s tokenizer. Families {plans}; {m['seconds']} s."
    how = pd.DataFrame([{"arm": a["name"], "url": a["url"], "dialect": a["dialect"],
                         "cold start by": a.get("cold_by"), "page size": a.get("page_size"),
                         "prefill chunk": a.get("chunked_prefill_size"),
                         "requests": sum(v for k, v in m["requests"].items() if k.endswith("/" + a["name"])),
                         "retries": sum(a.get("retries", {}).values()),
                         "cache re-runs": a.get("cache_reruns", 0)} for a in m["arms"]])
    sections = _sections(table, result.get("behaviour", pd.DataFrame())) + [
        Section("How it was run", "Cold starts use the engine's flush route (SGLang "
                "`/flush_cache`, vLLM `/reset_prefix_cache`); without one, two random leading tokens "
                "no earlier request had. Retries are transport faults retried under the shared "
                "policy, never counted as differences. Cache re-runs: replies that took more prompt "
                "tokens from the cache than their condition allows (a cold one any; a hit@P more "
                "than P: a retry of a request the server had processed), discarded, the cache "
                "flushed and the condition asked again.", [Table(how, fold=False)]),
        Section("Every probe", "One row per comparison (probes.csv).",
                [Table(result["probes"].drop(columns=["key", "tokens", "kl", "rank", "kl_window", "kl_floor",
                                                       "floor_window"],
                                              errors="ignore"), fold=True)]),
    ]
    return Page("dsv4-fidelity consistency report", compared, result["verdict"],
                lead_figures=["prefix_kl"], sections=sections, manifest=m)


def write_report(out_dir, run_id: str, result: dict):
    w = ReportWriter(out_dir, run_id)
    try:
        w.table("conditions", result["conditions"])
        w.table("probes", result["probes"].drop(columns=["reference"], errors="ignore"))
        if len(result.get("behaviour", [])):
            w.table("behaviour", result["behaviour"])
        w.json("manifest", {**result["manifest"], "verdict": result["verdict"]})
        for stem, (draw, title) in FIGURES.items():
            fig = draw(result["conditions"], result["probes"])
            if fig is not None:
                w.figure(fig, stem, title)
                plt.close(fig)
        page = build_page({**result, "probes": result["probes"].drop(columns=["reference"], errors="ignore")})
        w.page(page)
        return w.commit(latest=False)
    except BaseException:
        w.abort()
        raise
