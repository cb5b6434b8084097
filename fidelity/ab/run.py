"""`fidelity ab`'s run: prompts -> the arms' design (design.py) -> lockstep stage one ->
the factorial stage over the most effective toggles -> signals judged by
fidelity.verdict (the same judge as `fidelity kld`) -> tidy tables -> report. Everything
is computed from tidy tables."""
from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from infra.report_writer import ReportTarget
from kernel_toggles.arms import version_of
from reference_model.schedule import Schedule
from reference_model.version import parts_for

from ..weights.devices import arithmetic
from ..design.arms import check_schedules
from ..design.lengths import Boundaries
from ..design.prompts import Prompt, all_token_ids, builtin_prompts, describe, file_prompts
from ..verdict.attribution import attribute, bootstrap_mean_ci, outcome_matrix, prompt_outcomes
from ..verdict.judge import Bootstrap, Design, judge
from ..verdict.findings import (DEPARTURE_X, acted_only_at, near_enough, never_acted, with_departures,
                                with_never_acted)
from ..verdict.signals import SCHEDULE_FACTOR, direct_effects, prompt_signals, with_longest
from .design import (FLOOR, FLOOR_ORDER, GOLDEN, WEIGHTS_PREFIX, ABSettings, RunnerSettings,
                     Statistics, arm_sets, base_toggles, factorial_arms, floor_arms,
                     golden_arm, schedule_arms, toggle_arms, top_toggles, vs_pairs, weight_arms)
from .drift import (DISCRETE_TAPS, departure_at, first_divergence, largest_departure, steadiness,
                    with_floor_multiple)
from .lockstep import LockstepResult, LockstepRunner
from .runner_settings import RunSite
from .report import write_report


@dataclass
class _Stages:
    """What the lockstep stages ran and measured."""
    prompts: list           # what they ran on (fidelity.design.prompts.Prompt)
    res: LockstepResult
    sets: dict              # candidate arm -> its toggles (factors)
    toggles: list           # what attribution ranges over
    label_sets: dict        # stage one's toggle arms: label -> ToggleSet
    pairs: dict             # arm -> the --vs arm it is compared with directly
    outcomes: pd.DataFrame  # mean final-logit KLD per (arm, prompt) at the longest length
    table: dict             # toggle subset -> per-prompt outcomes (attribution's input)
    top: list               # toggles of the factorial stage
    floors: list            # floor arms run: the three noise floors, then golden per schedule


def run_ab(weights, settings: ABSettings, report: ReportTarget = ReportTarget(),
           site: RunSite = RunSite(print), tokenizer=None, variants: dict | None = None) -> dict:
    """`variants`: {name: WeightSource} of other checkpoints of the same architecture; each
    becomes an arm `weights:<name>` (golden numerics on those weights), so drift and KLD
    are attributed to the checkpoint as well as to the numerics toggles. `site.stage`: this
    rank's fidelity.pipeline.stage.Stage when the golden runs across processes (every rank
    gets the whole run's tables, so all take the same decisions)."""
    site = RunSite(site.progress or (lambda msg: None), site.stage)
    out_dir, run_id = report.out_dir, report.run_id
    t_start = time.time()
    cfg = weights.cfg
    prompts, longest = _prompts(cfg, settings, tokenizer)
    st = _stage_one(weights, settings, prompts, longest, site, variants)
    _stage_two(weights, settings, prompts, longest, site, st)
    tables, judged = _judged_tables(cfg, settings, prompts, longest, st)
    with_departures(judged["verdict"], _departures(tables["drift"], st.sets))
    kld = tables["kld"]
    with_never_acted(judged["verdict"], never_acted(kld, st.sets), acted_only_at(kld, st.sets),
                     sorted({int(L) for L in kld.length}) if len(kld) and "length" in kld else [],
                     Boundaries.of(cfg))
    result = {"manifest": _manifest(cfg, settings, st, run_id, t_start, site.stage),
              "verdict": judged["verdict"], "noise_floor": _noise_floor(st.outcomes, settings),
              "floors": judged["floors"].to_dict("records"),
              "first_divergence": _first_divergences(tables["drift"], tables["pairs"], st.sets, st.pairs,
                                                     settings.stats.floor_k),
              "events": st.res.events}
    if out_dir is not None:
        path = write_report(out_dir, run_id or time.strftime("ab-%Y%m%d-%H%M%S"), tables, result,
                            st.sets, st.res)
        result["path"] = str(path)
    result.update(tables)
    return result


def _prompts(cfg, settings: ABSettings, tokenizer) -> tuple[list[Prompt], str]:
    """The prompts and the group of the longest ones."""
    p = settings.prompts
    if p.prompts_file:
        if tokenizer is None and not all_token_ids(p.prompts_file):
            raise ValueError("--prompts with text or messages needs a tokenizer")
        return file_prompts(p.prompts_file, tokenizer, cfg.vocab_size, group="file"), "file"
    return (builtin_prompts(cfg, p.lengths, p.prompts_per_length, p.seed, tokenizer),
            f"L{max(p.lengths)}")


def _stage_one(weights, settings, prompts, longest, site: RunSite, variants) -> _Stages:
    """Golden, the floors, the design's toggle arms and the weight variants."""
    label_sets, toggles, schedules = arm_sets(settings, version_of(weights.cfg))
    check_schedules(schedules, [p.length for p in prompts])
    pairs = vs_pairs(settings.design.vs, label_sets)
    cd = getattr(torch, settings.runner.accumulate)
    w_arms = weight_arms(variants, cd)
    toggles = toggles + [a.name for a in w_arms]
    arms = ([golden_arm(cd)] + floor_arms(cd) + schedule_arms(schedules, cd)
            + toggle_arms(label_sets, cd, schedules) + w_arms)
    site.progress(f"stage 1: {len(arms)} arms × {len(prompts)} prompts, mode {settings.runner.mode}")
    res = _run(weights, arms, prompts, settings.runner, site, pairs)
    sets = {a.name: a.toggles for a in arms if a.role == "arm"}
    outcomes = prompt_outcomes(pd.DataFrame(res.kld), group=longest)
    return _Stages(prompts, res, sets, toggles, label_sets, pairs, outcomes,
                   outcome_matrix(outcomes, sets, GOLDEN), [], [a.name for a in arms if a.role == "floor"])


def _stage_two(weights, settings, prompts, longest, site: RunSite, st: _Stages) -> None:
    """Full factorial over the toggles with the largest single or leave-one-out effect."""
    idle = set(never_acted(pd.DataFrame(st.res.kld), st.sets))      # nothing to share out
    st.top = top_toggles([t for t in st.toggles if not t.startswith(WEIGHTS_PREFIX) and t not in idle], st.table,
                         settings.design.shapley_top)
    new = factorial_arms(st.top, st.table, st.sets) if len(st.top) >= 2 else {}
    if not new:
        return
    site.progress(f"stage 2: factorial over {', '.join(st.top)} ({len(new)} more arms)")
    cd = getattr(torch, settings.runner.accumulate)
    extra = _run(weights, [golden_arm(cd)] + toggle_arms(new, cd), prompts, settings.runner, site)
    extra.needle = [r for r in extra.needle if r["arm"] != GOLDEN]   # already in stage 1
    st.res.extend(extra)
    st.sets.update({k: frozenset(v.names) for k, v in new.items()})
    st.outcomes = prompt_outcomes(pd.DataFrame(st.res.kld), group=longest)
    st.table = outcome_matrix(st.outcomes, st.sets, GOLDEN)


def _judged_tables(cfg, settings, prompts, longest, st: _Stages) -> tuple[dict, dict]:
    """The run's tidy tables, its signals judged by fidelity.verdict (floors, attribution,
    verdict) with the --vs arm's direct effects."""
    res = st.res
    drift = with_floor_multiple(pd.DataFrame(res.drift), FLOOR)
    kld, needle = pd.DataFrame(res.kld), pd.DataFrame(res.needle)
    groups = {p.id: p.group for p in prompts}
    sig = with_longest(prompt_signals(drift, kld, needle, cfg.window_size), groups, longest)
    pair_df, pair_kld = pd.DataFrame(res.pairs), pd.DataFrame(res.pair_kld)
    direct, stats = None, settings.stats
    if len(pair_kld):
        pair_sig = with_longest(prompt_signals(pair_df, pair_kld, None, cfg.window_size), groups, longest)
        direct = direct_effects(pair_sig, st.sets, frozenset(st.label_sets[settings.design.vs].names),
                                stats.n_boot, stats.seed)
    judged = judge(sig, Design(GOLDEN, st.sets, st.toggles, st.floors, base_toggles(settings, version_of(cfg))),
                   Bootstrap(stats.n_boot, stats.seed), len(prompts), direct, describe(prompts))
    tables = {"drift": drift, "kld": kld, "attribution": _attribution(st.toggles, st.top, st.table, stats),
              "attribution_by_length": _per_length_attr(kld, st.sets, st.toggles, stats),
              "summary": _summary_table(drift, kld, judged["summary"], st.sets, st.floors), "signals": sig,
              "signal_summary": judged["summary"], "signal_attribution": judged["attribution"],
              "pairs": pair_df, "needle": needle}
    return tables, judged


def _noise_floor(outcomes: pd.DataFrame, settings) -> dict:
    """The QAT floor's mean final-logit KLD at the longest length, with its CI."""
    floor_vals = outcomes[outcomes.arm == FLOOR].sort_values("prompt").kld.to_numpy()
    fmean, flo, fhi = bootstrap_mean_ci(floor_vals, settings.stats.n_boot, settings.stats.seed)
    return {"mean": fmean, "lo": flo, "hi": fhi}


def _manifest(cfg, settings, st: _Stages, run_id, t_start, stage=None) -> dict:
    return {
        "run_id": run_id, "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
        "reference": parts_for(cfg).reference, "checkpoint": settings.checkpoint, "settings": asdict(settings),
        "arms": {k: sorted(v) for k, v in st.sets.items()}, "golden": GOLDEN, "floor": FLOOR,
        "floors": st.floors, "vs": settings.design.vs,
        "prompts": [{"id": p.id, "length": p.length, "group": p.group} for p in st.prompts],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "pandas": pd.__version__},
        "arithmetic": arithmetic(),
        "seconds": round(time.time() - t_start, 1),
        "pipeline": None if stage is None else {"ranks": stage.world, "layers": [
            [r.start, r.stop - 1] for r in stage.ranges]},
    }


def _run(weights, arms, prompts, r: RunnerSettings, site: RunSite, pairs=None) -> LockstepResult:
    return LockstepRunner(weights, arms, r, pairs, site).run(prompts)


def _first_divergences(drift, pair_df, sets, pairs, k) -> list[dict]:
    """Per arm: first divergence from golden and, for arms with a --vs arm, from it; both
    thresholds are k × the reduction-order floor."""
    out = []
    for a in sets:
        for vs in (None, pairs.get(a)) if a in pairs else (None,):
            f = first_divergence(drift, a, FLOOR_ORDER, k, pair_df, vs)
            if f:
                out.append(_on_its_path(f, sets[a]))
    return out


def _on_its_path(f: dict, factors) -> dict:
    """The phase label follows the path the tokens took: under decode_from(P) the prompt's
    tokens from P on went through the decode path one at a time, not through prefill."""
    for s in (Schedule.parse(x[len(SCHEDULE_FACTOR):]) for x in factors if x.startswith(SCHEDULE_FACTOR)):
        if s.kind == "decode_from" and f["phase"] == "prefill":
            f["phase"] = f"prefill to token {s.n}, decode path after"
    return f


def _departures(drift, sets) -> list[dict]:
    """Per arm holding a toggle: its first tensor tap at DEPARTURE_X x the reduction-order
    floor, with the QAT floor's multiple there (a kernel change the size of QAT's is
    expected); a one-toggle arm that never gets there, its largest multiple when it is
    steady across prompts (`below_bar`, `steady`: findings.near_enough; 9x is not noise
    either, only below the bar). Indexer picks and expert sets are left to the mechanism
    signals, judged against floors that are noise for them (their reduction-order floor is
    often 0)."""
    drift = drift[~drift.tap.isin(DISCRETE_TAPS)]
    out = []
    for a, factors in sets.items():
        toggles = [f for f in factors if not f.startswith(SCHEDULE_FACTOR)]
        f = first_divergence(drift, a, FLOOR_ORDER, DEPARTURE_X) if toggles else None
        if f is None and len(toggles) == 1:          # below the bar: said when it is steady
            near = largest_departure(drift, a, FLOOR_ORDER)
            if near:
                st = steadiness(drift, a, FLOOR_ORDER, near["phase"], near["layer"], near["tap"])
                if near_enough(near["ratio"], st):
                    out.append({**near, "toggle": toggles[0], "below_bar": True, "steady": st})
            continue
        if f:
            qat = departure_at(drift, FLOOR, f["phase"], f["layer"], f["tap"])
            f["qat_ratio"] = f["departure"] / qat if qat and np.isfinite(f["departure"]) else None
            f["toggle"] = toggles[0] if len(toggles) == 1 else None
            out.append(f)
    return out


def _attribution(toggles, top, table, stats: Statistics) -> pd.DataFrame:
    rows = [r for r in attribute(toggles, table, stats.n_boot, stats.seed)
            if r["method"] != "shapley" or len(toggles) <= 6]
    if len(top) >= 2:
        sub = {k: v for k, v in table.items() if k <= frozenset(top)}
        rows += [r for r in attribute(top, sub, stats.n_boot, stats.seed) if r["method"] == "shapley"]
    return pd.DataFrame(rows, columns=["toggle", "method", "value", "lo", "hi"])


def _per_length_attr(kld, sets, toggles, stats: Statistics) -> pd.DataFrame:
    rows = []
    for group in sorted(kld.group.unique(), key=lambda g: int(g[1:]) if g[1:].isdigit() else 0):
        t = outcome_matrix(prompt_outcomes(kld, group=group), sets, GOLDEN)
        for r in attribute(toggles, t, max(200, stats.n_boot // 5), stats.seed):
            if r["method"] != "shapley":
                rows.append({"group": group, **r})
    return pd.DataFrame(rows)


def _summary_table(drift, kld, sig_summary, sets, floors) -> pd.DataFrame:
    """Per arm: final-logit KLD summary (prefill, all buckets), decode KLD, and the worst
    place of each verdict signal (answer KLD, top-k recall, needle entry, experts)."""
    d = drift[(drift.tap == "logits") & (drift.bucket == "all")]
    rows = []
    for arm in list(floors) + list(sets):
        p = d[(d.arm == arm) & (d.phase == "prefill")]
        dec = kld[(kld.arm == arm) & (kld.phase == "decode")]
        if p.empty:
            continue
        ss = sig_summary[sig_summary.arm == arm].groupby("signal")["mean"].max()
        rows.append({"arm": arm, "kld_mean": p.kld_mean.mean(), "kld_p99": p.kld_p99.mean(),
                     "kld_max": p.kld_max.max(), "same_top1": p.same_top1.mean(),
                     "dp_mean": p.dp_mean.mean(),
                     "decode_kld_mean": dec.kld.mean() if len(dec) else np.nan,
                     "answer_kld": ss.get("answer_kld", np.nan),
                     "late_kld_excess": ss.get("late_kld_excess", np.nan),
                     "topk_recall_min": 1 - ss.get("topk_loss", np.nan),
                     "needle_lost_max": ss.get("needle_lost", np.nan),
                     "expert_same_min": 1 - ss.get("expert_disagree", np.nan)})
    return pd.DataFrame(rows)
