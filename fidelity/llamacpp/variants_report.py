"""llama.cpp's GGUF variants on one page: per variant (weights type, cache type, server
flags) its KLD against the golden with the floor, its KLD and verdict against its
in-process twin (what the engine does that its documented arithmetic does not explain),
top-1 agreement and needle recall. Read from `bench/bench_llama_cpp.py`'s results JSON
(`bench/results/llama_cpp.json`), so the page and docs/real-engines.md's table show the
same measured numbers; the unexplained judgement leads (docs/real-engines.md)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

REPORT = "llamacpp-variants"
# what the twin can and cannot model: its toggles come from the server's flags (cache type,
# repacking), none from the GGUF's weight type
TWIN_NOTE = ("A variant's twin is the exact profile with the toggles its llama-server flags map to "
             "(fidelity.llamacpp.flags); no toggle models a GGUF's weight type, so a quantized GGUF is "
             "judged against the F32 twin and its weight quantization is part of what stays unexplained.")
COLUMNS = ["GGUF", "mean KLD vs golden [CI] vs floor", "same top-1", "needle recall", "mean KLD vs its twin",
           "verdict vs its twin (unexplained)", "verdict vs golden (by design)"]


def key(variant: str) -> str:
    """A variant's name in file and run names ('F32 + KV q8_0' -> 'F32-KVq8_0')."""
    return variant.replace(" ", "").replace("+", "-")


def arm_of(variant: str) -> str:
    """The kld/needle arm name of a variant ('F32 + KV q8_0' -> 'llama-F32-KVq8_0')."""
    return "llama-" + key(variant)


def golden_verdict(v: str) -> str:
    """A golden verdict sentence cut to its finding: within the floors, or what breaks."""
    if v.startswith("No toggle stands out"):
        return "within the golden's floors"
    head, _, rest = v.partition(":")
    cleared = rest.split("outcome signals cleared:")[-1].strip().rstrip(".") if "cleared:" in rest else ""
    return head.split(" breaks ")[0].split("llama-")[-1] + " breaks coherence" + (f" ({cleared})" if cleared else "")


def twin_verdict(k: dict) -> str:
    """The twin judgement cut to its finding: unexplained (and what) or a match ('-' for a
    result measured before kld judged against the twin)."""
    if "twin_unexplained" not in k:
        return "-"
    if not k["twin_unexplained"]:
        return "matches its twin within the twin's floors"
    return "**unexplained**: " + k["twin_verdict"].split(": ", 1)[-1].split(";")[0].rstrip(".")


def variants_frame(res: dict, longest: str) -> pd.DataFrame:
    """One row per variant, every cell from the results JSON, as the page and the doc show it
    (`longest`: the needle length quoted beside the overall recall)."""
    rows = []
    for n, r in res["variants"].items():
        if "failed" in r:
            rows.append([n, "llama-server did not start: " + r["failed"].replace("|", "/")[:120]] + [""] * 5)
            continue
        k, arm, own = r["kld"], arm_of(n), r.get("needle", {})
        rec = own.get("recall", {}).get(arm)
        at = own.get("by_length", {}).get(f"{arm}@{longest}", float("nan"))
        rows.append([n, f"{k['kld_mean']:.3g} [{k['kld_lo']:.3g}, {k['kld_hi']:.3g}] vs {k['floor_kld_hi']:.3g} "
                        f"({k['kld_mean'] / k['floor_kld_hi']:.2g}x)", f"{k['same_top1']:.4f}",
                     "{:.2f} [{:.2f}, {:.2f}]".format(*rec) + f"; {at:.2f} at {longest}" if rec else "-",
                     _vs_twin(k),
                     twin_verdict(k), golden_verdict(k["verdict"])])
    return pd.DataFrame(rows, columns=COLUMNS)


def _vs_twin(k: dict) -> str:
    """The mean KLD against the twin, beside the twin's highest floor where it was recorded."""
    if "vs_twin" not in k:
        return "-"
    f = k.get("twin_floor_kld_hi")
    return f"{k['vs_twin']:.3g}" + (f" vs floor {f:.3g}" if f else "") + f" (`{k['twin']}`)"


def headline(res: dict) -> str:
    """The unexplained first: which variants depart from their twin beyond its floors, then
    the by-design picture against the golden, then the variants that did not serve."""
    ok = {n: r for n, r in res["variants"].items() if "failed" not in r}
    judged = {n: r for n, r in ok.items() if "twin_unexplained" in r["kld"]}
    bad = [n for n, r in judged.items() if r["kld"]["twin_unexplained"]]
    if not judged:
        twin = "No variant has been judged against its twin yet (rerun bench/bench_llama_cpp.py --kld)"
    elif bad:
        twin = (f"Unexplained by its twin: {', '.join(bad)} ({len(bad)} of {len(judged)} variants depart from "
                "the in-process twin of their own flags beyond its floors)")
    else:
        twin = f"All {len(judged)} variants match the in-process twin of their own flags within its floors"
    unjudged = [n for n in ok if n not in judged]
    if judged and unjudged:
        twin += f" ({', '.join(unjudged)} not judged against its twin yet)"
    broke = [n for n, r in ok.items() if not r["kld"]["verdict"].startswith("No toggle stands out")]
    golden = (f"against the golden, {', '.join(broke)} break{'s' if len(broke) == 1 else ''} coherence by design"
              if broke else "against the golden every variant stays within the golden's floors")
    failed = [n for n, r in res["variants"].items() if "failed" in r]
    return f"{twin}; {golden}." + (f" Did not serve: {', '.join(failed)}." if failed else "")


def plot_variants(res: dict):
    """KLD per variant against the golden (with its CI and floor) and against its twin, on
    one log axis; beside it needle recall per length, one line per variant."""
    ok = [(n, r) for n, r in res["variants"].items() if "failed" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    y = np.arange(len(ok))
    k = [r["kld"] for _, r in ok]
    mean = np.array([x["kld_mean"] for x in k])
    a.errorbar(mean, y, xerr=[mean - [x["kld_lo"] for x in k], np.array([x["kld_hi"] for x in k]) - mean],
               fmt="o", color="C0", capsize=3, label="vs golden [95% CI]")
    a.scatter([x.get("vs_twin", np.nan) for x in k], y, marker="s", color="C3", zorder=3, label="vs its twin")
    tf = np.array([x.get("twin_floor_kld_hi") or np.nan for x in k], dtype=float)
    if np.isfinite(tf).any():           # the floor the twin judgement rests on, a grey bar on its own row
        a.scatter(tf, y, marker="|", s=260, color="grey", zorder=2, label="its twin's highest floor")
    a.axvline(max(x["floor_kld_hi"] for x in k), color="grey", ls="--", lw=1, label="golden's highest floor")
    a.set_xscale("log")
    a.set_yticks(y, [n for n, _ in ok])
    a.invert_yaxis()
    a.set_xlabel("mean next-token KLD (decode path)")
    a.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    a.grid(axis="x", alpha=0.3)
    markers, ticks = "osD^v<>", []
    for i, (n, r) in enumerate(ok):
        by = r.get("needle", {}).get("by_length", {})
        pts = sorted((int(key.split("@")[1]), v) for key, v in by.items() if key.split("@")[0] == arm_of(n))
        if pts:                          # side by side within each length's slot: equal curves stay visible
            b.plot(np.arange(len(pts)) + 0.07 * (i - (len(ok) - 1) / 2), [v for _, v in pts],
                   marker=markers[i % len(markers)], label=n, alpha=0.85)
            ticks = [str(L) for L, _ in pts]
    gold = [(int(key.split("@")[1]), v) for key, v in
            (ok[-1][1].get("needle", {}).get("by_length", {}) if ok else {}).items() if key.startswith("golden@")]
    if gold:
        gold.sort()
        b.plot(range(len(gold)), [v for _, v in gold], color="black", ls="--", marker="o", mfc="none",
               label="golden (in-process)")
        ticks = [str(L) for L, _ in gold]
    if ticks:
        b.set_xticks(range(len(ticks)), ticks)
    b.set_ylim(-0.03, 1.03)
    b.set_xlabel("needle prompt length (tokens; one slot per length)")
    b.set_ylabel("recall")
    b.legend(fontsize=8, loc="lower left")
    b.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write(res: dict, out_dir: str | Path, kld_lengths: str, needle_lengths: str) -> Path:
    """<out_dir>/llamacpp-variants/: index.html, summary.md, variants.csv, variants.png."""
    longest = needle_lengths.split(",")[-1]
    table = variants_frame(res, longest)
    w = ReportWriter(out_dir, REPORT)
    try:
        w.table("variants", table)
        w.figure(plot_variants(res), "variants", "KLD and needle recall per variant",
                 "Left: mean KLD against the golden (blue, 95% bootstrap CI over prompts; dashed: the golden's "
                 "highest floor) and against the in-process twin of the variant's own flags (red; grey bar: the upper bound "
                 "of that twin's highest floor, where measured). Right: needle "
                 "recall per prompt length (single needle, depths 10/50/90), the golden's dashed; the variants "
                 "side by side within each length's slot, so equal curves stay visible.")
        compared = (f"Every GGUF variant of {res['model']} ({res['build']}) served by llama-server: `fidelity kld` "
                    f"on {kld_lengths} tokens (decode path) against the golden and against its in-process twin, "
                    f"`fidelity needle` on {needle_lengths} tokens (bench/bench_llama_cpp.py).")
        sections = [
            Section("Variants", "One row per variant. KLD against the golden: mean [95% CI] against the highest "
                    "in-process floor's upper bound (the mean over that bound in brackets). Against its twin: the "
                    "mean KLD and kld's judgement against the twin's own floors (`unexplained` = beyond them). "
                    "Needle: overall recall [95% CI] and at the longest length. " + TWIN_NOTE,
                    [Table(table, fold=False, markup=True)]),
        ]
        head = headline(res)
        w.page(Page("dsv4-fidelity llama.cpp variants", compared, [head], ["variants"], None,
                    ["python bench/bench_llama_cpp.py --kld   # the kld scoring again, both judgements",
                     "python bench/bench_llama_cpp.py --render   # this page and the doc from the stored results"],
                    sections, {"build": res["build"], "model": res["model"]}, headline=head))
        plt.close("all")
        return w.commit(latest=False)
    except BaseException:
        w.abort()
        raise
