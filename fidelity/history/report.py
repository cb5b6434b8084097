"""A history's timeline page, for any engine (fidelity.history.engine_history): per release, the
KLD against the golden and against its twin (with their floors) and needle recall, the releases
that could not be made ready or served with their reasons, the pairs compared with each other,
and at each change point whose change it is and where the two part. Read from the ledger only,
so it is rewritten after every release and a resumed history draws the same picture; the
engine adds its own columns (`row_columns`, `pair_columns`) and words (`describe`)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from . import pairs as P

REPORT = "report"


def _ci(d: dict | None) -> str:
    return f"{d['mean']:.3g} [{d['lo']:.3g}, {d['hi']:.3g}]" if d else ""


def _status(h, s: dict) -> str:
    """Where a release stopped, with the reason, or 'scored'."""
    for stage, words in (*h.READY, ("scored", "kld")):
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
    first = (h.READY[0][0] if h.READY else "scored")
    out = []
    for n in h.order({r["key"] for r in h.ledger.all(first)} | asked):
        s = h.summary(n)
        k, nd = s["scored"], s["needle"]
        out.append({"number": n, "build": h.label(n), "summary": s, "status": _status(h, s),
                    "kld": k if k and k["ok"] else None, "needle": nd if nd and nd["ok"] else None,
                    "probe": bool(asked) and n not in asked})
    return out


def builds_table(h) -> pd.DataFrame:
    rows = []
    items = timeline_builds(h)
    for t, own in zip(items, h.row_columns(items)):
        s, k, nd = t["summary"], t["kld"], t["needle"]
        rec = nd.get("recall") if nd else None
        needle = ({f"needle recall [CI] at {h.s.needle_length}": (f"{rec[0]:.2f} [{rec[1]:.2f}, {rec[2]:.2f}] (n={rec[3]})"
                                                                  if rec else (s["needle"] or {}).get("reason", "not run (a bisection probe)"))}
                  if h.s.needle_length else {})
        rows.append({
            h.UNIT: t["build"] + (" (bisection probe)" if t["probe"] else ""), "status": t["status"], **own,
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
    scored = h.order(n for n in asked if h.scored(n))
    keep = set(zip(scored, scored[1:])) | {tuple(r["change"]) for r in h.ledger.all("bisect") if r.get("change")}
    return [p for p in h.ledger.all("pair") if tuple(p["key"]) in keep]


def pairs_table(h) -> pd.DataFrame:
    rows = [{"from": p["a"], "to": p["b"], "kind": p["kind"], "signal": p.get("lead", "kld_mean"),
             "mean KL [95% CI]": f"{p['kl'][0]:.3g} [{p['kl'][1]:.3g}, {p['kl'][2]:.3g}]",
             "twin's floor (mean, upper)": f"{p['floor'][0]:.3g}, {p['floor'][2]:.3g}", "prompts (n)": p["prompts"],
             "bit-identical prompts": p["identical"], "above own floor": p["beyond"],
             "at >= 10x own floor (p)": _tail(p), **h.pair_columns(p)}
            for p in _in_order(h, current_pairs(h))]
    return pd.DataFrame(rows)


def _in_order(h, recs: list[dict], field: str = "key") -> list[dict]:
    """Ledger records keyed by a pair of releases, in release order."""
    rank = {json.dumps(k): i for i, k in enumerate(h.order({x for r in recs for x in r[field]}))}
    return sorted(recs, key=lambda r: tuple(rank[json.dumps(x)] for x in r[field]))


def change_lines(h) -> list[str]:
    """Each bisection and what the replay says at its change point; the engine's own findings."""
    loc = {tuple(r["key"]): r for r in h.ledger.all("localised")}
    why = {tuple(r["key"]): r for r in h.ledger.all("cause")}
    out = []
    for r in _in_order(h, h.ledger.all("bisect")):
        a, b = r["key"]
        span = f"{h.label(a)}..{h.label(b)}"
        if not r["ok"]:
            out.append(f"- {span}: not bisected: {r['reason']}")
            continue
        line = f"- {span}: {r['sentence']} ({h.UNIT}s scored: {', '.join(h.label(n) for n in r['tested'])})"
        if r.get("change"):
            c = why.get(tuple(r["change"]))
            if c is not None:
                line += ". What changed: " + (c["words"] if c["ok"] else f"not read: {c['reason']}")
            where = localised_words(h, loc.get(tuple(r["change"])))
            if where:
                line += ". " + where[:1].upper() + where[1:]
        out.append(line)
    return out + [f"- {x}" for x in h.findings()]


def _mark(h, loc: dict | None, cause: dict | None) -> str:
    """A change point's label beside its line: whose change, and the first tensor that parts."""
    who = h.whose(cause)
    first = ((loc or {}).get("tensors") or {}).get("first") if (loc or {}).get("ok") else None
    parts = [p for p in (who, first and f"at {first['tensor']}") if p]
    return f": {', '.join(parts)}" if parts else ""


def _tail(p: dict) -> str:
    d = (p.get("signals") or {}).get(p.get("lead", "kld_mean"))
    return f"{d['broken']} (p <= {d['p_value']:.2g})" if d else ""


def localised_words(h, r: dict | None) -> str:
    """Where the two releases at a change point part tensor by tensor ('' for an engine whose
    history does not replay)."""
    if r is None:
        return "not localised yet" if h.REPLAYS else ""
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
        only = (f"; only {h.label(a)} dumps {', '.join(t['only_a'][:4]) or 'nothing else'}, only {h.label(b)} "
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
    pos = {json.dumps(t["number"]): i for i, t in enumerate(builds)}
    scored = [t for t in builds if t["kld"]]
    for key, color, label in (("golden", "C0", "vs golden"), ("vs_twin", "C3", "vs its twin")):
        pts = [(pos[json.dumps(t["number"])], t["kld"][key], t) for t in scored if t["kld"].get(key)]
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
        if r.get("ok") and r.get("change") and json.dumps(r["change"][1]) in pos:
            a, b = r["change"]
            x = pos[json.dumps(b)] - .5
            ax.axvline(x, color="0.3", lw=1.2, ls=":")
            ax.text(x, 0.02, f" {h.label(a)}→{h.label(b)}{_mark(h, loc.get((a, b)), why.get((a, b)))}",
                    transform=ax.get_xaxis_transform(), fontsize=8, va="bottom", rotation=90,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=.85, pad=1))
    for a, b, label in h.marks():                    # the engine's own change points (mlx-vlm: its loader)
        if json.dumps(b) in pos:
            x = pos[json.dumps(b)] - .5
            ax.axvline(x, color="C1", lw=1.2, ls="-.")
            ax.text(x, 0.02, f" {h.label(a)}→{h.label(b)}: {label}", transform=ax.get_xaxis_transform(),
                    fontsize=8, va="bottom", rotation=90, color="C1",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=.85, pad=1))
    for t in builds:
        if t["status"].startswith("failed"):
            ax.text(pos[json.dumps(t["number"])], 0.02, "✕", transform=ax.get_xaxis_transform(), ha="center", color="C1",
                    fontsize=12)
    ax.set_yscale("log")
    ax.set_ylabel("mean KLD (final logits)")
    ax.grid(alpha=.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ticks = (np.arange(len(builds)), [t["build"] for t in builds])
    xlabel = f"{h.AXIS}; ✕ = not made ready or served"
    last = ax
    if needle:
        last = ax2
        ys = [(pos[json.dumps(t["number"])], *t["needle"]["recall"][:3]) for t in builds
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


def _change_words(h, a, b) -> str:
    """A → B (whose change, how far: where their tensors part)."""
    pair, cause = h.ledger.get("pair", [a, b]) or {}, h.ledger.get("cause", [a, b]) or {}
    who = h.whose(cause)
    head = ", ".join(x for x in (who and f"the {who}'s change", pair.get("kind")) if x)
    loc = h.ledger.get("localised", [a, b]) or {}
    first = (loc.get("tensors") or {}).get("first") if loc.get("ok") else None
    on = f" on {loc['prompt']}" if loc.get("prompt") else ""
    where = (f"first tensor apart `{first['tensor']}`{on}" if first else
             localised_words(h, loc or None).split(". ")[0])
    ends = f"{h.label(a)} → {h.label(b)}"
    inside = ": ".join(x for x in (head, where) if x)
    return f"{ends} ({inside})" if inside else ends


def _twin_words(h, scored: pd.DataFrame) -> str:
    """Whether every scored release departs from its twin (a bug no release fixed) or which do."""
    recs = [h.ledger.get("scored", t["number"]) for t in timeline_builds(h) if t["build"] in set(scored[h.UNIT])]
    judged = [r for r in recs if r and r.get("ok") and "unexplained" in r]
    bad = [r for r in judged if r["unexplained"]]
    if not judged or not bad:
        return ""
    lo, hi = (f(r["vs_twin"]["mean"] for r in bad) for f in (min, max))
    span = f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g} to {hi:.3g}"
    if len(bad) == len(judged):
        return f" Every {h.UNIT} scored departs from its twin (unexplained; mean KLD vs the twin {span})."
    return (f" {len(bad)} of {len(judged)} {h.UNIT}s depart from their twin (unexplained): "
            + ", ".join(h.label(r["key"]) for r in bad) + ".")


def headline(h) -> str:
    """One sentence: the change points found (with where they part), else that nothing changed."""
    df = builds_table(h)
    probe = df[h.UNIT].str.endswith("(bisection probe)")
    scored = df[(df.status == "scored") & ~probe]
    failed = df[df.status.str.startswith("failed")]
    fail = (f" {len(failed)} {h.UNIT}(s) could not be used: "
            + "; ".join(f"{u} ({st[len('failed: '):][:160]})" for u, st in zip(failed[h.UNIT], failed.status))
            + ".") if len(failed) else ""
    fail += _twin_words(h, scored) + "".join(f" {x}." for x in h.findings())
    what = f"{h.ENGINE} {h.UNIT}s"
    changes = [r for r in h.ledger.all("bisect") if r.get("ok") and r.get("change")]
    pairs = current_pairs(h)
    if changes:
        words = "; ".join(_change_words(h, *c["change"]) for c in _in_order(h, changes, "change"))
        probes = f" (and {int(probe.sum())} bisection probes)" if probe.any() else ""
        return f"{len(scored)} {what} scored{probes}; the numbers change at {words}.{fail}"
    moved = [p for p in pairs if p["kind"] != P.IDENTICAL]
    if moved:
        return (f"{len(scored)} {what} scored; the numbers change between "
                + ", ".join(f"{p['a']} and {p['b']} ({p['kind']})" for p in moved) + " (not bisected yet)." + fail)
    done = {tuple(p["key"]) for p in pairs}
    nums = [t["number"] for t in timeline_builds(h) if not t["probe"] and h.scored(t["number"])]
    if len(nums) > 1 and all((a, b) in done for a, b in zip(nums, nums[1:])):
        return (f"{len(scored)} {what} scored ({h.label(nums[0])}..{h.label(nums[-1])}): "
                f"every adjacent pair serves bit-identical distributions on every prompt.{fail}")
    if len(nums) > 1:
        return f"{len(scored)} {what} scored so far; they are compared once all are scored.{fail}"
    return f"{len(scored)} {what} scored so far.{fail}"


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
                     f"KLD and recall per {h.UNIT}" if needle else f"KLD per {h.UNIT}",
                     f"Per {h.ENGINE} {h.UNIT}: mean KLD against the golden (blue) and against its twin (red), "
                     "95% bootstrap CI over prompts, with each comparison's highest floor (dashed); dotted "
                     "lines: change points of the numbers found by bisection"
                     + ("; orange dash-dot lines: the engine's own change points" if h.marks() else "")
                     + ("; below, needle recall with the golden's band." if needle else "."))
            figs = ["timeline"]
        compared = h.describe()
        sections = [
            Section(f"{h.UNIT.capitalize()}s", f"Every {h.UNIT} asked for, in order; one that failed says where and why.",
                    [Table(df, fold=False)]),
            Section(f"{h.UNIT.capitalize()}s against each other",
                    f"Adjacent scored {h.UNIT}s compared prompt by prompt on what each served (KL of the earlier "
                    f"{h.UNIT}'s distribution to the later's, over the prompt and where the answer is produced), "
                    "judged as kld judges an arm against the twin's reduction-order floors, prompt by prompt: "
                    "below them a change re-associates, above them it changes what is computed. `signal`: the "
                    "one that decides; `at >= 10x own floor (p)`: the per-prompt tail test.",
                    [Table(pairs, fold=False)] if len(pairs) else []),
            Section("Change points", "\n".join(change_lines(h)) or "No bisection has run."),
        ]
        w.page(Page(f"dsv4-fidelity {h.ENGINE} history", compared, [headline(h)], figs, None,
                    [h.BISECT_HINT], sections, {"settings": h.s.record()}, headline=headline(h)))
        plt.close("all")
        return w.commit(latest=False)
    except BaseException:
        w.abort()
        raise
