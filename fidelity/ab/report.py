"""The `fidelity ab` report as a person reads it: what was compared, the verdict in one
sentence (what broke, where, how much against its floor; the full wording folded under
it), the signals board, the suspects (each toggle's strongest signal against its floor,
and which kind of finding it is) and the commands that would confirm it; then the
evidence, each table beside its plot, and the manifest folded at the end
(infra.report_page). `rerender` writes the page again from a report's own files."""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from ..verdict.board import (SUSPECTS_CAPTION, floor_label, headline, is_floor_arm, signal_board, signal_ratios,
                             suspects)
from ..verdict.findings import findings_table, verdict_lines
from ..verdict.judge import golden_follows
from ..design.lengths import Boundaries
from ..verdict.residues import CAPTION as RESIDUE_CAPTION
from ..verdict.residues import GRID_CAPTION
from ..verdict.residues import grid_frame, residue_table
from ..verdict.signals import SCHEDULE_FACTOR, SIGNALS, mechanism_floors
from ..verdict.tail import METHOD as TAIL
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


TABLES = {"drift": "drift.csv.gz", "kld": "kld.csv.gz", "signals": "signals.csv.gz", "pairs": "pairs.csv.gz",
          "attribution": "attribution.csv", "attribution_by_length": "attribution_by_length.csv",
          "summary": "summary.csv", "signal_summary": "signal_summary.csv",
          "signal_attribution": "signal_attribution.csv", "needle": "needle.csv"}


def _read(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()


def rerender(src, out_dir, run_id: str) -> Path:
    """The report in `src` written again by this code into out_dir/run_id, from its own
    tables and manifest (no model run): a report made before a change to the page reads
    like one made after it."""
    src = Path(src)
    tables = {name: _read(src / f) for name, f in TABLES.items()}
    saved = json.loads((src / "manifest.json").read_text())
    events = _read(src / "events.csv")
    result = {**saved, "events": events.to_dict("records")}
    sets = {a: frozenset(t) for a, t in saved["manifest"]["arms"].items()}
    return write_report(out_dir, run_id, tables, result, sets, SimpleNamespace(events=result["events"], kept={}))


def residues(signals: pd.DataFrame, manifest: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Answer KLD per arm and length residue (fidelity.verdict.residues), and each length's residue
    and boundary, from the run's signals and manifest (config, prompts, arms, floors)."""
    b = Boundaries.of(manifest["config"])
    lengths = {p["id"]: p["length"] for p in manifest["prompts"]}
    return (residue_table(signals, lengths, dict(manifest["arms"]), manifest["floors"], b),
            grid_frame(lengths.values(), b))


def _toggles(factors) -> list[str]:
    return [f for f in factors if not str(f).startswith(SCHEDULE_FACTOR)]


def _stage_one(m: dict) -> list[str] | None:
    """The arm labels the run's design asked for (design.arm_sets: --arm as typed, or the
    default's singles, base and base minus each); None when they cannot be re-derived
    (a plugin's toggle not loaded here)."""
    from reference_model.v41.config import is_v41_dict

    from .design import ABSettings, arm_sets
    d = m["settings"]["design"]
    try:
        labels, _, _ = arm_sets(ABSettings.of(arms=d["arms"], base=d["base"], schedule=d["schedule"]),
                                "v41" if is_v41_dict(m["config"]) else "v4")
    except (ValueError, KeyError, TypeError):
        return None
    return list(labels)


def plotted_arms(m: dict, sets: dict) -> tuple[list[str], dict[str, list[str]]]:
    """The candidate arms the line plots draw, and the ones left out by reason: every arm
    asked for (--arm, weights variants) is drawn; of the default design, the single
    toggles and the base (its leave-one-out arms are not); the factorial stage's
    combinations never are (they exist for Shapley values)."""
    first = _stage_one(m)
    if first is None:
        return list(sets), {}
    d = m["settings"]["design"]
    factorial = [a for a in sets if a not in first and not a.startswith("weights:")]
    loo = []
    if d["arms"] is None:
        base = d["base"] + (f"@{d['schedule']}" if d.get("schedule") else "")
        loo = [a for a in first if a in sets and a != base and len(_toggles(sets[a])) > 1]
    left = {"leave-one-out arms of the base": loo, "factorial-stage combinations (for Shapley)": factorial}
    out = set(loo) | set(factorial)
    return [a for a in sets if a not in out], {k: v for k, v in left.items() if v}


def _left_out(left: dict[str, list[str]], absent: dict[str, str] | None = None) -> str:
    """The caption's sentence on every arm a plot does not draw, and why."""
    parts = [f"{len(v)} {k} ({', '.join(v)})" if len(v) <= 4 else f"{len(v)} {k}" for k, v in left.items()]
    why: dict[str, list[str]] = {}
    for a, reason in (absent or {}).items():
        why.setdefault(reason, []).append(a)
    parts += [f"{', '.join(v)}: {reason}" for reason, v in why.items()]
    return (" Not drawn: " + "; ".join(parts) + " (every arm's numbers are in the CSVs).") if parts else ""


def _figures(w: ReportWriter, tables, result, sets):
    drift, kld = tables["drift"], tables["kld"]
    m = result["manifest"]
    floor_arms, qat_floor = list(m["floors"]), m["floor"]
    drawn, left = plotted_arms(m, sets)
    lines = floor_arms + drawn
    singles = [a for a in sets if len(_toggles(sets[a])) == 1 and a in drawn]
    w.figure(signal_board(tables["signal_summary"], tables["signal_attribution"], floor_arms + list(sets)),
             "signals", "Verdict signals vs their floors",
             "Each arm (a row; every arm of the run) against the highest floor's upper 95% bound for "
             "each signal and place: white within it, red by how far above (log scale); the floors' own "
             "rows in grey (the bar, not a finding), hatched no data. The signals are defined under "
             "Floors per signal.")
    fig = plots.drift_vs_layer(drift, qat_floor, lines, floors=floor_arms)
    w.figure(fig, "drift_vs_layer", "Drift vs layer",
             "Relative L2 of the residual stream after each layer vs golden (prefill, mean over prompts); "
             f"floors in grey with hollow markers, the band: {qat_floor} over prompts (min–max)."
             + _left_out(left, fig.absent))
    if singles:
        w.figure(plots.toggle_layer_heatmap(drift, singles), "toggle_layer_heatmap", "Toggle × layer",
                 "Relative L2 of the residual stream of each single-toggle arm per layer (log colour "
                 "scale over the non-zero cells; white 0: identical to golden; grey: no data).")
    attr, floor_hi, floor_arm = attribution_rows(tables, result)
    if not attr.empty:
        missing = [t for t in dict.fromkeys(t for a in drawn for t in _toggles(sets[a]))
                   if t not in set(attr.toggle)]
        w.figure(plots.attribution_bars(attr, floor_hi, f"highest floor ({floor_arm})"), "attribution",
                 "Attribution of final-logit KLD",
                 "Bars: point estimate; whiskers: 95% bootstrap CI over prompts; red: the interval clears "
                 "the highest floor (dashed). One panel per method the run could compute."
                 + _unattributed(missing))
    fig = plots.kld_distribution(kld, floor_arms + drawn)
    w.figure(fig, "kld_distribution", "KLD distribution per arm",
             "Per-position KLD(golden ‖ arm) of the final logits, prefill, log axis." + _left_out(left, fig.absent))
    fig = plots.topk_recall_vs_position(drift, lines, floors=floor_arms)
    w.figure(fig, "topk_recall", "Indexer top-k recall vs context position",
             "Fraction of golden's selected compressed entries the arm also selects, by query position "
             "bucket; an arm whose curve repeats (=) or hides under (≈) another's is ringed and says so "
             "in the legend."
             + _left_out(left, fig.absent))
    fig = plots.decode_drift(kld, lines, floors=floor_arms)
    w.figure(fig, "decode_drift", "Decode-step drift",
             "Teacher-forced decode on golden's greedy tokens: mean KLD per step." + _left_out(left, fig.absent))
    if "golden_margin" in tables["needle"]:
        full = [a for a in drawn if len(_toggles(sets[a])) > 1][:1]
        w.figure(plots.selection_margins(tables["needle"], m["golden"], full + singles[:3]),
                 "selection_margins", "Selection margins", "Golden's margin of the needle entry to "
                 "the indexer's top-k boundary at the question; dashed: twice an arm's largest score "
                 "shift (the first multi-toggle arm and up to three single toggles).")


def _unattributed(missing: list[str]) -> str:
    """The caption's words on toggles of drawn arms that no pair of arms isolates."""
    if not missing:
        return ""
    names = ", ".join(missing) if len(missing) <= 4 else f"{len(missing)} toggles of the multi-toggle arms"
    return (f" Not attributed: {names}: no pair of arms here differs by it alone (add it alone, or the "
            "base with and without it).")


def attribution_rows(tables: dict, result: dict) -> tuple[pd.DataFrame, float, str]:
    """Δ mean final-logit KLD per toggle and method at the longest length: the factorial
    attribution (one-at-a-time, leave-one-out, Shapley) plus the verdict's other measured
    effects on the same signal and place (added to the base, under a schedule, against
    the --vs arm), so a toggle found only that way is not missing; and the highest floor
    there (its upper bound, and which floor)."""
    attr, sa = tables["attribution"], tables["signal_attribution"]
    where = _longest_place(sa)
    k = sa[(sa.signal == "kld_mean") & (sa["where"] == where)] if len(sa) else sa
    floor_hi, floor_arm = result["noise_floor"]["hi"], result["manifest"]["floor"]
    if len(k) and "floor_hi" in k:
        floor_hi, floor_arm = float(k.floor_hi.iloc[0]), str(k.floor_arm.iloc[0])
    extra = k[~k.method.isin(set(attr.method)) & (k.method != TAIL) & ~k.method.str.startswith("exact_")] \
        if len(k) else k
    cols = ["toggle", "method", "value", "lo", "hi"]
    rows = pd.concat([attr[cols], extra[cols]], ignore_index=True) if len(extra) else attr[cols]
    return rows, floor_hi, floor_arm


def _longest_place(sa: pd.DataFrame) -> str:
    """'final logits @ L<longest>' when the run had several lengths, else 'final logits'."""
    places = set(sa["where"]) if len(sa) else set()
    longer = sorted((w for w in places if str(w).startswith("final logits @ L")),
                    key=lambda w: int(w.rsplit("L", 1)[1]) if w.rsplit("L", 1)[1].isdigit() else 0)
    return longer[-1] if longer else "final logits"


def summary_ratios(summary: pd.DataFrame, sig_summary: pd.DataFrame, floors: pd.DataFrame) -> pd.DataFrame:
    """For each arm row of the summary table and each signal column: the worst place's mean
    over that place's highest floor (what colours the arms table); none for a floor's row
    (the QAT floor against the other floors is the floor's own size, not a finding)."""
    board = signal_ratios(sig_summary, floors, list(summary.arm))
    out = pd.DataFrame(index=range(len(summary)))
    for col, (signal, _) in SUMMARY_SIGNALS.items():
        cols = [c for c in board.columns if c.startswith(signal + " @ ")]
        worst = board[cols].max(axis=1) if cols else pd.Series(dtype=float)
        out[col] = [np.nan if is_floor_arm(a) else worst.get(a, np.nan) for a in summary.arm]
    return out


def next_steps(result, sus: pd.DataFrame) -> list[str]:
    """Commands that would confirm (or sharpen) the verdict, spelled as `fidelity ab`,
    `needle` and `kld` parse them (tests/test_report_pages.py parses every one): the
    culprit the outcome names is taken out of the base it is part of (`engine-t`), or, when
    it was added to the base, run alone and on the base at longer context; a mechanism-only
    finding is asked whether it reaches the outcome at longer context; a toggle that acted at
    some lengths only is run first at the lengths that tell the config's periods apart."""
    m = result["manifest"]
    v = result["verdict"]
    ck = "" if str(m["checkpoint"]).startswith("embedded:") else f" --checkpoint {shlex.quote(m['checkpoint'])}"
    named = v.get("named") or []
    mech = v.get("mechanism") or []
    if named:
        t, sched = named[0]["toggle"], named[0].get("schedule") or ""
    elif mech:
        t, sched = mech[0]["toggle"], ""
    elif len(sus):
        t, sched = sus.iloc[0].toggle, ""
    else:
        t, sched = None, ""
    q = shlex.quote
    periods = [f"fidelity ab{ck} --arm {q(name)} --lengths {','.join(map(str, L))}"
               f"   # which of the config's periods {name} acts at" for name, L in v.get("separating_lengths", {}).items()]
    if t is None or not _is_toggle(t):    # nothing, or a weights variant: more context and prompts
        return periods + [f"fidelity ab{ck} --long --reps 18   # more context, more prompts"]
    at = f"@{sched}" if sched else ""
    if named:
        base, with_t, without_t = _base_with_and_without(m["settings"]["design"]["base"], t, m)
        if without_t == "golden":         # the base is t alone: more power instead
            out = [f"fidelity ab{ck} --arm {q(t + at)} --long --reps 18   "
                   f"# {t} with more context and prompts"]
        elif without_t is not None:       # t is part of the base: take it out
            out = [f"fidelity ab{ck} --arm {q(base + at)} --arm {q(without_t + at)} --vs {q(base + at)} --long"
                   f"   # {t} taken out of {base}: does that remove the finding?"]
        else:                             # t was added to the base: alone and on the base, longer
            out = [f"fidelity ab{ck} --arm {q(t + at)} --arm {q(base + at)} --arm {q(with_t + at)} "
                   f"--vs {q(base + at)} --long   # {t} alone and on {base}, up to 2047 tokens: does it grow?"]
    else:
        out = [f"fidelity ab{ck} --arm {q(t)} --long --reps 18   "
               f"# does {t}'s change inside reach the outcome at longer context?"]
    out.append(f"fidelity needle{ck} --arm golden=golden --arm {q(f'{t}={t}{at}')}   # does {t} cost recall?")
    out.append(f"fidelity kld{ck} --arm golden=golden --arm {q(f'{t}={t}{at}')} --exact"
               f"   # exact KL of {t} on the same prompts")
    return periods + out


def _is_toggle(name: str) -> bool:
    from kernel_toggles import registry
    try:
        registry.get(name)
    except ValueError:
        return False
    return True


def _base_with_and_without(base: str, t: str, m: dict) -> tuple[str, str, str | None]:
    """The base as `--vs` finds it among the arms (an `engine` spelling as typed, other
    arms in canonical order, as design.arm_sets labels them), the base with t added, and
    the base without t when t is in it (`engine-t`, else the remaining toggles; `golden`
    when none remain); None when t is not in the base."""
    from kernel_toggles.arms import ToggleSet, is_engine_spelling
    from reference_model.v41.config import is_v41_dict
    try:
        ts = ToggleSet.parse(base, "v41" if is_v41_dict(m["config"]) else "v4")
    except ValueError:                      # a plugin's toggle not loaded here
        ts = None
    label = base if ts is None or base.startswith("engine") else str(ts)
    if ts is None or t not in ts:
        return label, f"{label},{t}", None
    return label, label, f"{base}-{t}" if is_engine_spelling(base) else str(ts.without(t))


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
    summary = tables["summary"]
    attr = attribution_rows(tables, result)[0]
    floors = pd.DataFrame(result["floors"])
    lengths = ", ".join(str(n) for n in sorted({p["length"] for p in m["prompts"]}))
    compared = (f"Model `{m['config_hash']}` ({m['checkpoint']}): golden vs {len(sets)} arms and "
                f"{len(floor_names)} noise floors on {len(m['prompts'])} prompts of {lengths} tokens, "
                f"{runner['decode_steps']} teacher-forced decode steps, mode {runner['mode']}, "
                f"seed {st['prompts']['seed']}.{golden_follows(m)}")
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
        Section("Drift vs layer", "", [], ["drift_vs_layer"]),
        Section("Arms", "Per arm: final-logit KLD (prefill), decode KLD and the worst place of each "
                "verdict signal. Colour: the worst place's value over that place's highest floor; the "
                "floors' rows (named so, the QAT floor too) are not coloured.",
                [Table(summary.assign(arm=summary.arm.map(floor_label)),
                       ratio=summary_ratios(summary, tables["signal_summary"], floors), fold=False)]),
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
                "one-at-a-time, leave-one-out and Shapley (exact over the factorial stage), and the "
                "verdict's directly measured effects on the same signal and place (added to the base, "
                "under a schedule, against the --vs arm).",
                [Table(attr, summary=f"{len(attr)} rows (toggle × method)")], ["attribution"]),
        Section("Floors per signal", "Upper 95% bound of the highest floor, per signal and place. "
                "Signals: " + "; ".join(f"**{k}**: {v}" for k, v in SIGNALS.items()) + ".",
                [Table(floors, summary=f"{len(floors)} signal × place floors")]),
        Section("Logit drift", "", [], ["kld_distribution", "decode_drift"]),
        Section("Indexer selection", "", [], ["topk_recall"]),
        _margins_section(tables["needle"], m["golden"]),
    ]
    by_res, grid = residues(tables["signals"], m)
    sections.insert(4, Section("By length residue", RESIDUE_CAPTION,
                               [Table(by_res, summary=f"{len(by_res)} arm × residue rows"),
                                Table(grid, caption=GRID_CAPTION)]))
    if result["events"]:
        ev = pd.DataFrame(result["events"])
        sections.append(Section("Events", "", [Table(ev, summary=f"{len(ev)} events")]))
    return Page("dsv4-fidelity A/B report", compared, verdict, ["signals"],
                Table(sus, ratio=sus[["x_floor"]] if len(sus) else None, caption=SUSPECTS_CAPTION, fold=False),
                next_steps(result, sus), sections,
                {k: v for k, v in m.items() if k != "config"},
                headline=headline(v, result["first_divergence"], sets))


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
