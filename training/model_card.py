"""Write models/tiny-needle/MODEL_CARD.md from the training log and the sweep results:
loss curve PNG, recall by length × depth with Wilson intervals, recall by length, the
indexer mechanism rate by CSA layer, and eval/smoke.json (the cell the smoke test re-runs).

    python -m training.model_card models/tiny-needle --sweeps a.jsonl,b.jsonl \
        --train-lengths 256,384,513,642 --smoke-length 384

Sweeps may be labelled (`near4=a.jsonl+b.jsonl,single=c.jsonl`): the notes then place
each label's tables with {{RECALL_TABLE:label}}, {{MECHANISM_TABLE:label}},
{{MECHANISM_BY_LENGTH:label}}, {{DISCRIMINATION:label}} (multikey: distractor needles the
indexer kept), {{COMPARE:label1,label2,...}} (recall by length side by side) and
{{PAIRED:a/b,c/d,...}} (exact McNemar of sweep a against b on their shared trials), and
--smoke-label picks the smoke cell's sweep (its haystack spec goes into smoke.json).
--context takes labelled multi-arm sweeps (golden first, e.g. `fidelity needle --arm golden
--arm index_keys_fp8 ...`): {{CONTEXT_RECALL:label}} is recall by length per arm against
golden (exact McNemar), {{CONTEXT_MECHANISM:label}} what each arm does to the indexer's
picks and the needle entry's margin, {{CONTEXT_TREND:label}} those margins and shifts by
length; eval/context_summary.json holds their numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _rows(paths):
    from needle.results import latest, read_rows
    out = []
    for p in paths:
        _, rows = read_rows(p)
        out += latest(rows)
    return out


def loss_curve(log: list[dict], path: Path, smooth: int = 25):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ema(v):
        out, m = [], None
        for x in v:
            m = x if m is None else m + (x - m) / smooth
            out.append(m)
        return out

    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, lab in (("answer_ce", "answer CE"), ("lm_ce", "other tokens CE (weight 0.1)"),
                     ("index_kl", "indexer KL")):
        ax[0].plot(steps, ema([r[key] for r in log]), label=lab)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_title(f"losses (EMA over {smooth} steps)")
    ax[1].plot(steps, ema([r["seq_acc"] for r in log]), label="all answer tokens right (teacher-forced)")
    for layer in sorted({k for r in log for k in r.get("hits", {})}, key=int):
        ax[1].plot(steps, ema([r["hits"].get(layer, float("nan")) for r in log]),
                   label=f"layer {layer}: needle entry in indexer top-k")
    ax[1].set_ylim(0, 1.12)
    ax[1].set_xlabel("step")
    ax[1].set_title("training batches")
    ax[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    ax[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
    for a in ax:
        for r0, r1 in zip(log, log[1:]):
            if r0["phase"] != r1["phase"] or r0.get("stage") != r1.get("stage"):
                a.axvline(r1["step"], color="grey", lw=0.8, ls="--")
    for r0, r1 in zip([{}] + log, log):                  # name each stage where it starts
        if r1.get("stage") and r1["stage"] != r0.get("stage"):
            ax[1].text(r1["step"], 1.06, f" stage {r1['stage']}", fontsize=8, va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(r):
    if r["recall"] is None:
        return "-"
    return f"{r['recall']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] (n={r['n_scored']})"


def tables(rows, train_lengths) -> dict:
    from needle.stats import wilson
    from needle.tables import by_length, cells, mechanism
    c, bl, mech = cells(rows), by_length(rows), mechanism(rows)
    tr = [r for r in rows if r["length"] in train_lengths and r["outcome"] in
          ("correct", "partial", "wrong", "refused", "other", "empty")]
    k = sum(r["recall"] for r in tr)
    lo, hi = wilson(k, len(tr))
    pooled = {"n": len(tr), "recall": k / len(tr) if tr else None, "ci_low": lo, "ci_high": hi}
    return {"cells": c, "by_length": bl, "mechanism": mech, "train_pooled": pooled}


def markdown_tables(t, train_lengths) -> list[str]:
    lengths = sorted({r["length"] for r in t["cells"]})
    depths = sorted({r["depth"] for r in t["cells"]})
    get = {(r["length"], r["depth"]): r for r in t["cells"]}
    md = ["| length | " + " | ".join(f"depth {d:g}%" for d in depths) + " | all depths |",
          "|---|" + "---|" * (len(depths) + 1)]
    bl = {r["length"]: r for r in t["by_length"]}
    for L in lengths:
        tag = " (train)" if L in train_lengths else ""
        cells = []
        for d in depths:
            r = get.get((L, d))
            cells.append("-" if r is None or r["recall"] is None else
                         f"{r['recall']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] n={r['n_scored']}")
        md.append(f"| {L}{tag} | " + " | ".join(cells) + f" | **{_ci(bl[L])}** |")
    p = t["train_pooled"]
    if p["n"]:
        md += ["", f"Pooled over the training lengths: recall **{p['recall']:.3f}**, Wilson 95% "
               f"interval [{p['ci_low']:.3f}, {p['ci_high']:.3f}] over {p['n']} trials."]
    return md


def mechanism_md(t) -> list[str]:
    md = ["| CSA layer | needle entry in top-k: correct trials | all trials [Wilson] | "
          "missed trials | median rank (all) |", "|---|---|---|---|---|"]
    for m in t["mechanism"]:
        f = (lambda v: "-" if v is None else f"{v:.3f}")
        md.append(f"| {m['layer']} | {f(m['in_topk_rate_correct'])} | "
                  f"{m['in_topk_rate']:.3f} [{m['ci_low']:.2f}, {m['ci_high']:.2f}] n={m['n']} | "
                  f"{f(m['in_topk_rate_missed'])} | {m['median_rank']} |")
    return md


def mechanism_by_length(rows) -> list[str]:
    """in-top-k rate among correct trials, per CSA layer and length."""
    from collections import defaultdict
    g = defaultdict(list)
    for r in rows:
        if r["outcome"] != "correct":
            continue
        for m in r.get("mechanism") or []:
            if m.get("in_topk") is not None and not m.get("in_window"):
                g[(m["layer"], r["length"])].append(m["in_topk"])
    layers = sorted({k[0] for k in g})
    lengths = sorted({k[1] for k in g})
    md = ["| length | " + " | ".join(f"layer {i}" for i in layers) + " |",
          "|---|" + "---|" * len(layers)]
    for L in lengths:
        md.append(f"| {L} | " + " | ".join(
            f"{sum(g[(i, L)]) / len(g[(i, L)]):.2f} (n={len(g[(i, L)])})" if g[(i, L)] else "-"
            for i in layers) + " |")
    return md


def smoke_cell(rows, length, reps, depths, seed) -> dict:
    """The cell the smoke test re-runs: the first `reps` repetitions at `length` (same trial
    ids as in the card's sweep, so the same haystacks)."""
    from needle.stats import wilson
    rs = [r for r in rows if r["length"] == length and r["rep"] < reps and r["depth"] in depths]
    k = sum(r["recall"] for r in rs)
    lo, hi = wilson(k, len(rs))
    return {"length": length, "depths": depths, "reps": reps, "seed": seed, "n": len(rs),
            "recall": k / len(rs), "ci_low": lo, "ci_high": hi}


def _labelled(text: str) -> dict[str, list[Path]]:
    """"a.jsonl,b.jsonl" -> {"": [a, b]}; "x=a.jsonl+b.jsonl,y=c.jsonl" -> {"x": [a, b], "y": [c]}."""
    out: dict[str, list[Path]] = {}
    for part in text.split(","):
        label, _, paths = part.rpartition("=")
        out.setdefault(label, []).extend(Path(x) for x in paths.split("+"))
    return out


def _spec(paths) -> dict:
    from needle.results import read_rows
    header, _ = read_rows(paths[0])
    return header["trials"]["spec"]


def discrimination_md(rows, spec: dict, tokenizer) -> list[str]:
    from needle.haystack import HaystackSpec
    from training.evaluate import discrimination
    d = discrimination(rows, HaystackSpec(**{k: v for k, v in spec.items() if k != "template"}), tokenizer)
    md = ["| CSA layer | queried needle kept | distractor needles kept (mean, of "
          f"{d[0]['n_distractors'] if d else '-'}) | any distractor kept | clean: queried kept, "
          "no distractor [Wilson] | clean among correct trials |", "|---|---|---|---|---|---|"]
    for r in d:
        md.append(f"| {r['layer']} | {r['queried_kept']:.3f} | {r['dist_kept']:.2f} | "
                  f"{r['any_dist_kept']:.3f} | {r['clean']:.3f} [{r['clean_ci'][0]:.2f}, "
                  f"{r['clean_ci'][1]:.2f}] n={r['n']} | {r['clean_correct']:.3f} |")
    return md


def compare_md(groups: dict[str, list[dict]], labels: list[str]) -> list[str]:
    from needle.tables import by_length
    bl = {lab: {r["length"]: r for r in by_length(groups[lab])} for lab in labels}
    lengths = sorted({L for lab in labels for L in bl[lab]})
    md = ["| length | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for L in lengths:
        md.append(f"| {L} | " + " | ".join(_ci(bl[lab][L]) if L in bl[lab] else "-"
                                           for lab in labels) + " |")
    return md


def paired_md(groups: dict[str, list[dict]], pairs: list[tuple[str, str]]) -> list[str]:
    """Two labelled sweeps on the same trial ids (same haystacks): the trials only one of
    them gets right, both right, and the exact McNemar p (two-sided binomial on the
    discordant pairs)."""
    from needle.stats import mcnemar
    md = ["| pair | trials | only the first right | only the second right | both right | "
          "exact McNemar p |", "|---|---:|---:|---:|---:|---|"]
    for a, b in pairs:
        rb = {r["trial_id"]: r for r in groups[b]}
        both = [(r["outcome"] == "correct", rb[r["trial_id"]]["outcome"] == "correct")
                for r in groups[a] if r["trial_id"] in rb]
        m = mcnemar([x for x, _ in both], [y for _, y in both])
        md.append(f"| {a} vs {b} | {m.n} | {m.a_only} | {m.b_only} | "
                  f"{sum(x and y for x, y in both)} | {m.p_value:.2g} |")
    return md


def _fill_labelled(md: str, groups, specs, train_lengths, tokenizer) -> tuple[str, dict]:
    import re
    summaries = {}
    for lab, rows in groups.items():
        if not lab:
            continue
        t = tables(rows, train_lengths)
        summaries[lab] = t
        md = md.replace(f"{{{{RECALL_TABLE:{lab}}}}}", "\n".join(markdown_tables(t, train_lengths)))
        md = md.replace(f"{{{{MECHANISM_TABLE:{lab}}}}}", "\n".join(mechanism_md(t)))
        md = md.replace(f"{{{{MECHANISM_BY_LENGTH:{lab}}}}}", "\n".join(mechanism_by_length(rows)))
        if f"{{{{DISCRIMINATION:{lab}}}}}" in md:
            md = md.replace(f"{{{{DISCRIMINATION:{lab}}}}}",
                            "\n".join(discrimination_md(rows, specs[lab], tokenizer)))
    for m in re.findall(r"\{\{PAIRED:([^}]*)\}\}", md):
        md = md.replace(f"{{{{PAIRED:{m}}}}}", "\n".join(
            paired_md(groups, [tuple(x.split("/")) for x in m.split(",")])))
    for m in re.findall(r"\{\{COMPARE:([^}]*)\}\}", md):
        md = md.replace(f"{{{{COMPARE:{m}}}}}", "\n".join(compare_md(groups, m.split(","))))
    return md, summaries


def context_recall_md(rows) -> list[str]:
    """Recall by length for every arm of a multi-arm sweep, the first arm (golden) the
    baseline: each arm's pooled recall with its Wilson interval and the exact McNemar test
    against the baseline on the same haystacks."""
    from needle.tables import by_arm, by_length, pairs
    arms = by_arm(rows)
    base = arms[0]["arm"]
    bl = {(r["arm"], r["length"]): r for r in by_length(rows)}
    lengths = sorted({L for _, L in bl})
    pooled = {r["arm_b"]: r for r in pairs(rows) if r["scope"] == "all"}
    md = ["| arm | " + " | ".join(str(L) for L in lengths) + " | all [95% Wilson] | vs "
          f"{base}: only {base} right / only the arm right, exact McNemar p |",
          "|---|" + "---:|" * len(lengths) + "---|---|"]
    for s in arms:
        a = s["arm"]
        per = " | ".join("-" if bl.get((a, L), {}).get("recall") is None else f"{bl[(a, L)]['recall']:.2f}"
                         for L in lengths)
        p = pooled.get(a)
        vs = "" if p is None else f"{p['a_only']} / {p['b_only']}, p = {p['p_value']:.2g}"
        md.append(f"| {a} | {per} | {s['recall']:.3f} [{s['ci_low']:.2f}, {s['ci_high']:.2f}] "
                  f"n={s['n_scored']} | {vs} |")
    return md


def context_mechanism_md(rows) -> list[str]:
    """Per arm and CSA layer, against the first arm on the same trials: how much of the
    indexer's picks it changes, whether it ever changes the needle's entry being picked,
    and how far the needle entry sits from the top-k boundary against the arm's shift of
    it (needle.tables.mechanism_pairs)."""
    from needle.tables import mechanism, mechanism_pairs
    base = {m["layer"]: m for m in mechanism(rows) if m["arm"] == rows[0]["arm"]}
    md = ["| arm | CSA layer | picks Jaccard (mean) | identical pick sets | needle entry kept: "
          "only golden / only the arm, exact p | golden's margin to the boundary (median) | "
          "the arm's shift of it (median) | fragile: margin within 2× the shift |",
          "|---|---|---|---|---|---|---|---|"]
    f = (lambda v, fmt: "-" if v is None else format(v, fmt))
    for m in mechanism_pairs(rows):
        if m["layer"] == "all":
            continue
        margin = base.get(m["layer"], {}).get("margin_median")
        md.append(f"| {m['arm_b']} | {m['layer']} | {m['picks_jaccard_mean']:.3f} | "
                  f"{m['identical_picks']}/{m['n']} | {m['a_only']} / {m['b_only']}, p = "
                  f"{m['p_value']:.2g} | {f(margin, '.2f')} | {f(m['margin_shift_median'], '.3f')} | "
                  f"{f(m['fragile_rate'], '.3f')} |")
    return md


def context_trend_md(rows) -> list[str]:
    """Per CSA layer and length: golden's margins of the needle entry (median, smallest)
    against the arms' shifts of them on the same trials (the largest per-arm median, the
    largest single shift, each with its arm), and the trials where some arm's shift
    reaches half the margin -- how the distance to the boundary and the optimizations'
    push on it move with context."""
    import statistics
    from collections import defaultdict
    base = rows[0]["arm"]
    gold = {(r["trial_id"], m["layer"]): m["margin"] for r in rows if r["arm"] == base
            for m in r.get("mechanism") or [] if m.get("margin") is not None and not m.get("in_window")}
    margins, shifts = defaultdict(list), defaultdict(lambda: defaultdict(list))
    fragile = defaultdict(set)
    for r in rows:
        for m in r.get("mechanism") or []:
            g = gold.get((r["trial_id"], m["layer"]))
            if g is None or m.get("margin") is None:
                continue
            key = (m["layer"], r["length"])
            if r["arm"] == base:
                margins[key].append(g)
                continue
            shift = abs(m["margin"] - g)
            shifts[key][r["arm"]].append(shift)
            if abs(g) < 2 * shift:
                fragile[key].add(r["trial_id"])
    md = ["| CSA layer | length | trials | golden's margin: median (smallest) | largest median "
          "shift (arm) | largest single shift (arm) | fragile trials: some arm's shift "
          "over half golden's margin |", "|---|---:|---:|---|---|---|---:|"]
    for key in sorted(margins):
        by_arm = shifts[key]
        med = max(((statistics.median(v), a) for a, v in by_arm.items()), default=None)
        top = max(((max(v), a) for a, v in by_arm.items()), default=None)
        f = (lambda x: "-" if x is None else f"{x[0]:.3f} ({x[1]})")
        md.append(f"| {key[0]} | {key[1]} | {len(margins[key])} | {statistics.median(margins[key]):.2f} "
                  f"({min(margins[key]):.2f}) | {f(med)} | {f(top)} | {len(fragile[key])} |")
    return md


def _in_arm_order(paths) -> list[dict]:
    """A multi-arm sweep's rows with the arms in the order the command named them (the
    header's), not the order trials finished in: golden first, the engine last."""
    from needle.results import read_rows
    header, _ = read_rows(paths[0])
    order = {a["name"]: i for i, a in enumerate((header or {}).get("arms", []))}
    return sorted(_rows(paths), key=lambda r: order.get(r["arm"], len(order)))


def _fill_context(md: str, paths: dict[str, list[Path]]) -> tuple[str, dict]:
    """{{CONTEXT_RECALL:label}}, {{CONTEXT_MECHANISM:label}} and {{CONTEXT_TREND:label}} from
    --context sweeps, and their numbers for eval/context_summary.json."""
    from needle.tables import by_length, mechanism_pairs, pairs
    out = {}
    for lab, ps in paths.items():
        rows = _in_arm_order(ps)
        md = md.replace(f"{{{{CONTEXT_RECALL:{lab}}}}}", "\n".join(context_recall_md(rows)))
        md = md.replace(f"{{{{CONTEXT_TREND:{lab}}}}}", "\n".join(context_trend_md(rows)))
        md = md.replace(f"{{{{CONTEXT_MECHANISM:{lab}}}}}", "\n".join(context_mechanism_md(rows)))
        out[lab] = {"by_length": by_length(rows), "pairs": [p for p in pairs(rows) if p["scope"] != "cell"],
                    "mechanism_pairs": mechanism_pairs(rows)}
    return md, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--sweeps", required=True)
    p.add_argument("--train-lengths", required=True)
    p.add_argument("--smoke-length", type=int, required=True)
    p.add_argument("--smoke-reps", type=int, default=3)
    p.add_argument("--smoke-depths", default="0,25,50,75,100")
    p.add_argument("--notes", default=None, help="Markdown file with the hand-written sections")
    p.add_argument("--smoke-label", default="", help="labelled sweeps: the smoke cell's label")
    p.add_argument("--context", default=None,
                   help="labelled multi-arm sweeps (label=a.jsonl+b.jsonl,...), golden first: "
                        "recall vs context per arm and its mechanism, placed by the notes")
    a = p.parse_args(argv)
    root = Path(a.model)
    (root / "eval").mkdir(exist_ok=True)
    log = [json.loads(line) for line in (root / "training_log.jsonl").read_text().splitlines()]
    run = json.loads((root / "training_run.json").read_text())
    loss_curve(log, root / "loss_curve.png")
    paths = _labelled(a.sweeps)
    groups = {lab: _rows(ps) for lab, ps in paths.items()}
    train_lengths = [int(x) for x in a.train_lengths.split(",")]
    notes = Path(a.notes or Path(__file__).with_name("card_notes.md")).read_text()
    md = notes
    seed = 0
    rows = groups.get(a.smoke_label, [])
    smoke = smoke_cell(rows, a.smoke_length, a.smoke_reps, [float(x) for x in a.smoke_depths.split(",")], seed)
    if a.smoke_label:
        from reference_model.tokenizer import load_tokenizer
        smoke["spec"] = {k: v for k, v in _spec(paths[a.smoke_label]).items() if k != "template"}
        md, summaries = _fill_labelled(md, groups, {lab: _spec(ps) for lab, ps in paths.items() if lab},
                                       train_lengths, load_tokenizer(root / "tokenizer.json"))
        (root / "eval" / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
    else:
        t = tables(rows, train_lengths)
        (root / "eval" / "summary.json").write_text(json.dumps(t, indent=1) + "\n")
        md = md.replace("{{RECALL_TABLE}}", "\n".join(markdown_tables(t, train_lengths)))
        md = md.replace("{{MECHANISM_TABLE}}", "\n".join(mechanism_md(t)))
        md = md.replace("{{MECHANISM_BY_LENGTH}}", "\n".join(mechanism_by_length(rows)))
    if a.context:
        md, context = _fill_context(md, _labelled(a.context))
        (root / "eval" / "context_summary.json").write_text(json.dumps(context, indent=1) + "\n")
    (root / "eval" / "smoke.json").write_text(json.dumps(smoke, indent=1) + "\n")
    md = md.replace("{{TRAIN_SECONDS}}", f"{run['train_seconds']:.0f}")
    md = md.replace("{{SMOKE}}", json.dumps(smoke))
    (root / "MODEL_CARD.md").write_text(md)
    print(f"wrote {root / 'MODEL_CARD.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
