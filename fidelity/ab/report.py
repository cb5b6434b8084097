"""The `fidelity ab` report as a person reads it: what was compared, the verdict, the
signals board and drift vs layer, the suspects (each toggle's strongest signal against
its floor) and the command that would confirm it; then the evidence tables, each beside
its plot, and the manifest folded at the end (infra.report_page)."""
from __future__ import annotations

import shlex

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from ..verdict.board import signal_board, signal_ratios, suspects
from ..verdict.findings import findings_table, verdict_lines
from ..lengths import Boundaries
from ..residues import CAPTION as RESIDUE_CAPTION
from ..residues import grid_frame, residue_table
from ..verdict.signals import SCHEDULE_FACTOR, SIGNALS, mechanism_floors
from . import plots
from .margins import margin_table, margin_trend

# summary-table column -> (verdict signal, how the column relates to it)
SUMMARY_SIGNALS = {"kld_mean": ("kld_mean", 1), "kld_p99": ("kld_p99", 1), "answer_kld": ("answer_kld", 1),
                   "late_kld_excess": ("late_kld_excess", 1), "topk_recall_min": ("topk_loss", -1),
                   "needle_lost_max": ("needle_lost", 1), "expert_same_min": ("expert_disagree", -1)}


def write_report(out_dir, run_id, tables: dict, result, sets, res):
    w = ReportWriter(out_dir, run_id)
    try:
        for name, df in tables.items():
            w.table(name, df, gzip=name in ("drift", "kld", "signals", "pairs"))
        w.table("residues", residues(tables["signals"], result["manifest"])[0])
        w.table("events", pd.DataFrame(res.events, columns=["prompt", "arm", "phase", "step", "layer",
                                                            "event", "detail"]))
        w.json("manifest", {k: result[k] for k in ("manifest", "verdict", "noise_floor", "floors",
                                                    "first_divergence")})
        if res.kept:
            torch.save({"|".join(map(str, k)): v for k, v in res.kept.items()}, w.tmp / "kept_taps.pt")
        _figures(w, tables, result, sets)
        w.page(build_page(tables, result, sets))
        plt.close("all")
        return w.commit()
    except BaseException:
        w.abort()
        raise


def residues(signals: pd.DataFrame, manifest: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Answer KLD per arm and length residue (fidelity.residues), and each length's residue
    and boundary, from the run's signals and manifest (config, prompts, arms, floors)."""
    b = Boundaries.of(manifest["config"])
    lengths = {p["id"]: p["length"] for p in manifest["prompts"]}
    return (residue_table(signals, lengths, list(manifest["arms"]), manifest["floors"], b),
            grid_frame(lengths.values(), b))


def _plotted_arms(sets) -> tuple[list[str], list[str]]:
    """Single-toggle arms, and the full arm(s) (sets no other arm contains)."""
    names = list(sets)
    singles = [a for a in names if len(sets[a]) == 1]
    full = [a for a in names if len(sets[a]) > 1 and not any(sets[a] < sets[b] for b in names)]
    return singles, full


def _figures(w: ReportWriter, tables, result, sets):
    drift, kld, attr = tables["drift"], tables["kld"], tables["attribution"]
    floor_arms = result["manifest"]["floors"]
    qat_floor = result["manifest"]["floor"]
    arm_names = list(sets)
    singles, full = _plotted_arms(sets)
    w.figure(signal_board(tables["signal_summary"], tables["signal_attribution"], list(floor_arms) + arm_names),
             "signals", "Verdict signals vs their floors",
             "Each arm's mean of each signal over the highest floor's upper 95% bound for that "
             "signal and place (log scale): red is above every floor, blue below, grey no data. "
             "Signals: " + "; ".join(f"{k}: {v}" for k, v in SIGNALS.items()) + ".")
    w.figure(plots.drift_vs_layer(drift, qat_floor, list(floor_arms) + singles + full), "drift_vs_layer",
             "Drift vs layer", "Relative L2 of the residual stream after each layer vs golden "
             "(prefill, mean over prompts) for each single toggle and the full arm(s); grey "
             "band: reference-vs-exact noise floor; other arms are in drift.csv.gz.")
    if singles:
        w.figure(plots.toggle_layer_heatmap(drift, singles), "toggle_layer_heatmap",
                 "Toggle × layer", "log10 relative L2 of each single-toggle arm per layer.")
    if not attr.empty:
        w.figure(plots.attribution_bars(attr, result["noise_floor"]["hi"]), "attribution",
                 "Attribution of final-logit KLD",
                 "Bars: point estimate; whiskers: 95% bootstrap CI over prompts; red: clears the floor.")
    w.figure(plots.kld_distribution(kld, [qat_floor] + arm_names), "kld_distribution",
             "KLD distribution per arm", "Per-position KLD(golden ‖ arm) of the final logits, prefill.")
    w.figure(plots.topk_recall_vs_position(drift, list(floor_arms) + singles + full), "topk_recall",
             "Indexer top-k recall vs context position", "Fraction of golden's selected compressed "
             "entries the arm also selects, by query position bucket.")
    w.figure(plots.decode_drift(kld, [qat_floor] + arm_names), "decode_drift", "Decode-step drift",
             "Teacher-forced decode on golden's greedy tokens.")
    if "golden_margin" in tables["needle"]:
        w.figure(plots.selection_margins(tables["needle"], result["manifest"]["golden"], full + singles[:3]),
                 "selection_margins", "Selection margins", "Golden's margin of the needle entry to "
                 "the indexer's top-k boundary at the question; dashed: twice an arm's largest score "
                 "shift (first full arm and up to three single toggles).")


def summary_ratios(summary: pd.DataFrame, sig_summary: pd.DataFrame, floors: pd.DataFrame) -> pd.DataFrame:
    """For each arm row of the summary table and each signal column: the worst place's mean
    over that place's highest floor (what colours the arms table)."""
    board = signal_ratios(sig_summary, floors, list(summary.arm))
    out = pd.DataFrame(index=range(len(summary)))
    for col, (signal, _) in SUMMARY_SIGNALS.items():
        cols = [c for c in board.columns if c.startswith(signal + " @ ")]
        worst = board[cols].max(axis=1) if cols else pd.Series(dtype=float)
        out[col] = [worst.get(a, np.nan) for a in summary.arm]
    return out


def next_steps(result, sus: pd.DataFrame) -> list[str]:
    """Commands that would confirm (or sharpen) the verdict."""
    m = result["manifest"]
    ck = "" if str(m["checkpoint"]).startswith("embedded:") else f" --checkpoint {shlex.quote(m['checkpoint'])}"
    if sus.empty:
        return [f"fidelity ab{ck} --long --prompts-per-length 18   # more context, more prompts"]
    top = sus.iloc[0]
    t = top.toggle
    if bool(top.named):
        base = m["settings"]["design"]["base"]
        out = [f"fidelity ab{ck} --arms {shlex.quote(base)} --arms {shlex.quote(f'{base}-{t}')} "
               f"--vs {shlex.quote(base)} --long   # {t} removed from {base}: does it explain the finding?",
               f"fidelity needle --arm golden=golden --arm {t}={shlex.quote(t)}   # does it cost recall?"]
    else:
        out = [f"fidelity ab{ck} --arms {shlex.quote(t)} --long --prompts-per-length 18   "
               f"# the largest effect ({t}) with more power"]
    out.append(f"fidelity kld --inprocess golden=golden --inprocess {t}={shlex.quote(t)} --exact"
               f"   # exact KL of {t} on the same prompts")
    return out


def _serving_departures(v: dict, fd: pd.DataFrame, sets: dict) -> list[str]:
    """For each toggle the verdict names under a schedule: where its arm under that schedule
    first departs (the boundary is the schedule's: a chunk size, a cached prefix)."""
    found = {(n["toggle"], n["schedule"]) for n in v.get("named", []) if n.get("schedule")}
    found |= {(f["toggle"], s["schedule"]) for f in v.get("mechanism", []) for s in f["signals"]
              if s.get("schedule")}
    lines = []
    for toggle, sched in sorted(found):
        arms = [a for a, fs in sets.items() if set(fs) == {toggle, f"{SCHEDULE_FACTOR}{sched}"}]
        rows = fd[fd.arm.isin(arms)] if len(fd) else fd
        if len(rows):
            r = rows.iloc[0]
            lines.append(f"Under {sched}: `{r.arm}` first departs from {r.vs} at layer {r.layer} "
                         f"`{r.tap}` ({r.phase}), {r.ratio:.3g}× the reduction-order floor.")
    return lines


def build_page(tables, result, sets) -> Page:
    m = result["manifest"]
    st = m["settings"]
    runner, design = st["runner"], st["design"]
    floor_names = m["floors"]
    summary, attr = tables["summary"], tables["attribution"]
    floors = pd.DataFrame(result["floors"])
    lengths = sorted({p["length"] for p in m["prompts"]})
    compared = (f"Model `{m['config_hash']}` ({m['checkpoint']}): golden vs {len(sets)} arms and "
                f"{len(floor_names)} noise floors on {len(m['prompts'])} prompts at {lengths} tokens, "
                f"{runner['decode_steps']} teacher-forced decode steps, mode {runner['mode']}, "
                f"seed {st['prompts']['seed']}.")
    sus = suspects(tables["signal_attribution"])
    fd = pd.DataFrame(result["first_divergence"])
    v = result["verdict"]
    verdict = verdict_lines(v)
    base_fd = fd[fd.arm == design["base"]] if len(fd) else fd
    if len(base_fd):
        r = base_fd.iloc[0]
        verdict.append(f"`{r.arm}` first departs from {r.vs} at layer {r.layer} `{r.tap}` ({r.phase}), "
                       f"{r.ratio:.3g}× the reduction-order floor.")
    verdict += _serving_departures(v, fd, sets)
    nf = result["noise_floor"]
    verdict.append(f"QAT noise floor (reference vs exact, mean final-logit KLD at the longest length): "
                   f"{nf['mean']:.3g} [{nf['lo']:.3g}, {nf['hi']:.3g}].")
    named = pd.DataFrame(result["verdict"].get("named", []))
    sections = [
        Section("Arms", "Per arm: final-logit KLD (prefill), decode KLD and the worst place of each "
                "verdict signal. Colour: the worst place's value over that place's highest floor.",
                [Table(summary, ratio=summary_ratios(summary, tables["signal_summary"], floors), fold=False)]),
        Section("Outcome: named by the verdict", "A toggle is named when, for some outcome signal "
                "(KLD, answer KLD), its one-at-a-time / leave-one-out / Shapley interval (95% paired "
                f"bootstrap over prompts) lies wholly above the highest of the floors "
                f"({', '.join(floor_names)}) for that signal and place; an effect under a schedule "
                "(arm@S + t vs arm@S) against the serving floors: every floor but the QAT one, which "
                "is the same on both sides of a cache hit.", [Table(named)]),
        Section("Mechanism: what the arms change inside", "Indexer selection (top-k recall per CSA "
                "layer), the needle's indexer entry at the question, expert sets per MoE layer, each "
                "judged against the floors that are noise for it "
                f"({', '.join(mechanism_floors(floor_names))}), not QAT's systematic difference. "
                "The needle's entry is a 0/1 outcome: counted over prompts × CSA layers and tested exactly (McNemar, one-sided) against each floor, or "
                "against the arm one toggle smaller.", [Table(findings_table(v.get("mechanism", [])))]),
        Section("First divergence", "First place in forward order (prefill, then decode) where an arm "
                f"departs from `vs` (golden, or the --vs arm) by more than {st['stats']['floor_k']}× the "
                "reduction-order floor (fp32 instead of fp64 accumulation). Departure: rel L2 (tensors), 1 − recall "
                "(indexer picks), 1 − same expert set (routing).",
                [Table(fd, ratio=fd[["ratio"]] if len(fd) else None)], ["toggle_layer_heatmap"]),
        Section("Attribution of mean final-logit KLD", "Δ mean final-logit KLD at the longest length: "
                "one-at-a-time, leave-one-out and Shapley (exact over the factorial stage).",
                [Table(attr, summary=f"{len(attr)} rows (toggle × method)")], ["attribution"]),
        Section("Floors per signal", "Upper 95% bound of the highest floor, per signal and place.",
                [Table(floors, summary=f"{len(floors)} signal × place floors")]),
        Section("Logit drift", "", [], ["kld_distribution", "decode_drift"]),
        Section("Indexer selection", "", [], ["topk_recall"]),
        _margins_section(tables["needle"], m["golden"]),
    ]
    by_res, grid = residues(tables["signals"], m)
    sections.insert(3, Section("By length residue", RESIDUE_CAPTION,
                               [Table(by_res, summary=f"{len(by_res)} arm × residue rows"),
                                Table(grid, caption="Each length's residue and the boundary it sits "
                                      "at (window, index_topk × ratio, multiples of the largest ratio).")]))
    if result["events"]:
        ev = pd.DataFrame(result["events"])
        sections.append(Section("Events", "", [Table(ev, summary=f"{len(ev)} events")]))
    return Page("dsv4-fidelity A/B report", compared, verdict, ["signals", "drift_vs_layer"],
                Table(sus, ratio=sus[["x_floor"]] if len(sus) else None,
                      caption="Each toggle's strongest signal: value (95% CI) against the highest floor "
                              "for that signal and place; named = the interval clears it.", fold=False),
                next_steps(result, sus), sections,
                {k: v for k, v in m.items() if k != "config"})


def _margins_section(needle: pd.DataFrame, golden: str) -> Section:
    """How close the needle entry sits to being dropped, per arm, layer and length."""
    t, trend = margin_table(needle, golden), margin_trend(needle, golden)
    return Section("Selection margins", "At the question's last token, per CSA layer: golden's margin "
                   "of the needle entry to the top-k boundary (score minus the best score left out; "
                   "negative when it is out), each arm's score shift against golden (median, max) and "
                   "*fragility*: the share of prompts whose golden margin is within twice the arm's "
                   "largest shift (Wilson 95% interval). The trend is a least-squares line in "
                   "log2(length) through golden's median margins -- an extrapolation, not a measurement.",
                   [Table(t, summary=f"{len(t)} arm × layer × length rows"),
                    Table(trend, caption="Golden's median margin vs length (extrapolated to 2× and 4× "
                          "the longest length).")], ["selection_margins"] if len(t) else [])
