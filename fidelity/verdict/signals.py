"""The verdict's signals: several per-prompt outcomes, each judged against its own floors.

Mean next-token KLD at short context barely moves when the indexer stops selecting the
right entries, so the verdict also reads the KLD tail, the KLD where the answer is
produced, indexer top-k recall per CSA layer, whether the needle's entry is still picked
at the question, expert-set agreement per MoE layer and how KLD grows along the context.
Each signal is one number per (arm, prompt, where), so the attribution machinery and the
paired bootstrap apply unchanged; a toggle is named when the lower end of its interval
clears the highest floor's upper end for that signal (judge.py). Binary signals (the
needle's entry lost) are also counted over all trials and tested exactly (binary.py).

A new signal goes here only: its name and meaning in SIGNALS, its smallest floor in
FLOOR_EPS, and its extraction in prompt_signals (from `fidelity ab`'s lockstep tables)
and/or http_signals (from `fidelity kld`'s comparisons over HTTP)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .attribution import Bootstrap, attribute, bootstrap_mean_ci, outcome_matrix
from .spikes import SIGNAL as SPIKES, spike_shares

# signal -> what it measures (larger = worse for every signal)
SIGNALS = {
    "kld_mean": "mean final-logit KLD over prompt positions",
    "kld_p99": "99th percentile of final-logit KLD over prompt positions",
    "answer_kld": "final-logit KLD where the answer is produced (question end + decode steps)",
    "late_kld_excess": "KLD growth along the context: mean KLD at positions >= 4 windows "
                       "minus mean KLD inside the first window",
    "topk_loss": "1 - indexer top-k recall vs golden (prefill, per CSA layer)",
    "needle_lost": "needle's compressed entry picked by golden at the question but not by the arm",
    "expert_disagree": "1 - fraction of tokens with golden's expert set (per MoE layer)",
    "top1_disagree": "1 - fraction of prompt positions whose most likely next token is the "
                     "baseline's (HTTP arms)",
    "nonfinite": "fraction of prompt positions where a side reported NaN or infinite "
                 "log-probabilities (HTTP arms; no KL is defined there)",
    "kl_spikes": "fraction of prompt positions whose KLD is at least 1000x the floors' at that "
                 "position (the per-token tail: a wrong token every few thousand; HTTP arms)",
}
# Mechanism signals say what an arm changes inside the model (which entries the indexer
# picks, which experts run); outcome signals say what reaches the output. A mechanism
# change is judged only against the floors that are noise for it (judge.Design.
# mechanism_floors: tie order, reduction order), not against a systematic difference such
# as quantisation-aware training's; outcome signals against every floor.
MECHANISM = ("topk_loss", "needle_lost", "expert_disagree")
# reference vs exact numerics (`fidelity ab`'s QAT floor): noise for the outcome, a
# systematic difference for the mechanism (its picks differ by design)
QAT_FLOOR = "floor:exact"
# what a mechanism signal changes, in the verdict's words
MECHANISM_WHAT = {"topk_loss": "indexer selection", "needle_lost": "the needle's indexer entry",
                  "expert_disagree": "expert routing"}


def kind(signal: str) -> str:
    return "mechanism" if signal in MECHANISM else "outcome"


def mechanism_floors(floors: list[str]) -> list[str]:
    """The floors mechanism signals are judged against: every floor but the QAT one (unless
    it is the only one)."""
    return [f for f in floors if f != QAT_FLOOR] or list(floors)


# smallest floor a ratio is taken against (a floor of exactly 0 would make any change infinite)
FLOOR_EPS = {"kld_mean": 1e-6, "kld_p99": 1e-6, "answer_kld": 1e-6, "late_kld_excess": 1e-6,
              "topk_loss": 1e-3, "needle_lost": 1e-3, "expert_disagree": 1e-3, "top1_disagree": 1e-3,
              "nonfinite": 1e-3, "kl_spikes": 1e-4}
COLUMNS = ["arm", "prompt", "signal", "where", "value"]


def prompt_signals(drift: pd.DataFrame, kld: pd.DataFrame, needle: pd.DataFrame,
                   window: int) -> pd.DataFrame:
    """Tidy table: one value per (arm, prompt, signal, where)."""
    parts = []
    pre = kld[kld.phase == "prefill"]
    g = pre.groupby(["arm", "prompt"])["kld"]
    parts.append(_frame(g.mean(), "kld_mean"))
    parts.append(_frame(g.quantile(0.99), "kld_p99"))
    ans = kld[(kld.phase == "decode") | ((kld.phase == "prefill") & (kld.position == kld.length - 1))]
    parts.append(_frame(ans.groupby(["arm", "prompt"])["kld"].mean(), "answer_kld"))
    late = pre[pre.position >= 4 * window].groupby(["arm", "prompt"])["kld"].mean()
    early = pre[pre.position < window].groupby(["arm", "prompt"])["kld"].mean()
    parts.append(_frame((late - early).dropna(), "late_kld_excess"))
    d = drift[(drift.phase == "prefill") & (drift.bucket == "all")] if not drift.empty else drift
    if "recall" in d:
        t = d[d.tap == "attn.index.topk"]
        parts.append(_frame(1 - t.set_index(["arm", "prompt", "layer"])["recall"], "topk_loss", True))
    if "expert_set_same" in d:
        e = d[d.tap == "ffn.router.experts"]
        parts.append(_frame(1 - e.set_index(["arm", "prompt", "layer"])["expert_set_same"],
                            "expert_disagree", True))
    if needle is not None and not needle.empty:
        lost = (needle.golden_picked & ~needle.picked).astype(float)
        parts.append(_frame(lost.set_axis(pd.MultiIndex.from_frame(needle[["arm", "prompt", "layer"]])),
                            "needle_lost", True))
    return pd.concat(parts, ignore_index=True)[COLUMNS]


# signals also judged on the longest prompts alone: a bug that acts only past some context
# length is diluted by the shorter prompts in the all-prompt mean
LONG_SIGNALS = ("kld_mean", "answer_kld", "topk_loss", "needle_lost")


def with_longest(sig: pd.DataFrame, prompt_group: dict[str, str], longest: str) -> pd.DataFrame:
    """Adds LONG_SIGNALS restricted to the prompts of the longest length group, their
    place suffixed `@ <group>` (only when there are shorter groups too)."""
    groups = sig.prompt.map(prompt_group)
    if groups.nunique() < 2:
        return sig
    extra = sig[(groups == longest) & sig.signal.isin(LONG_SIGNALS)]
    return pd.concat([sig, extra.assign(where=extra["where"] + f" @ {longest}")], ignore_index=True)


def _frame(series: pd.Series, signal: str, per_layer: bool = False) -> pd.DataFrame:
    df = series.rename("value").reset_index()
    df["signal"] = signal
    df["where"] = df.pop("layer").map(lambda i: f"layer {int(i)}") if per_layer else "final logits"
    return df


def http_signals(t: dict[str, pd.DataFrame], floors: list[str] | None = None) -> pd.DataFrame:
    """The verdict's per-(arm, prompt) signals from HTTP comparisons (fidelity.kld.compare's
    tables): KL lower bound mean and p99 over the prompt, KL where the answer is produced
    (last prompt position and the ladder), top-1 disagreement, the share of positions far
    beyond the `floors` there (spikes.py: the per-token tail), and the capture signals per
    layer."""
    pos = t["positions"]
    pre = pos[pos.phase == "prefill"]
    g = pre.groupby(["arm", "prompt"])
    parts = [g.kl_lb.mean().rename("kld_mean"), g.kl_lb.quantile(0.99).rename("kld_p99"),
             (1 - g.same_top1.mean()).rename("top1_disagree")]
    if "nonfinite" in pre:
        parts.append(g.nonfinite.mean().rename("nonfinite"))
    last = pre.groupby(["arm", "prompt"]).position.transform("max") == pre.position
    ans = pd.concat([pre[last], pos[pos.phase == "decode"]]).groupby(["arm", "prompt"]).kl_lb.mean()
    parts.append(ans.rename("answer_kld"))
    rows = []
    for ser in parts:
        for (arm, prompt), v in ser.items():
            rows.append({"arm": arm, "prompt": prompt, "signal": ser.name, "where": "final logits",
                         "value": float(v)})
    if floors:
        rows += [{"arm": r.arm, "prompt": r.prompt, "signal": SPIKES, "where": "final logits",
                  "value": r.value} for r in spike_shares(pos, floors).itertuples()]
    caps = t["captures"]
    for _, r in caps.iterrows():
        rows.append({"arm": r.arm, "prompt": r.prompt, "signal": r.signal, "where": f"layer {int(r.layer)}",
                     "value": float(r.value)})
    return pd.DataFrame(rows, columns=COLUMNS)


def signal_summary(sig: pd.DataFrame, n_boot: int, seed: int) -> pd.DataFrame:
    """Per arm, signal and place: mean over prompts with a bootstrap 95% CI."""
    rows = []
    for (arm, s, w), grp in sig.groupby(["arm", "signal", "where"], sort=False):
        v = grp.sort_values("prompt").value.to_numpy(float)
        m, lo, hi = bootstrap_mean_ci(v, n_boot, seed)
        rows.append({"arm": arm, "signal": s, "where": w, "mean": m, "lo": lo, "hi": hi, "n": len(v)})
    return pd.DataFrame(rows, columns=["arm", "signal", "where", "mean", "lo", "hi", "n"])


# signals no noise can produce, judged against 0 whatever the floor arms show (an engine
# scored again and compared with itself is as non-finite as the engine)
NO_NOISE = {"nonfinite": "no noise makes logits non-finite"}


def floor_levels(summary: pd.DataFrame, floors: list[str],
                 mechanism_floors: list[str] | None = None) -> pd.DataFrame:
    """Per signal and place: the highest floor's upper CI bound, and which floor it is.
    Mechanism signals look only at `mechanism_floors` (default: all `floors`); NO_NOISE
    signals have a floor of 0."""
    mech = floors if mechanism_floors is None else mechanism_floors
    is_mech = summary.signal.isin(MECHANISM)
    f = summary[((~is_mech & summary.arm.isin(floors)) | (is_mech & summary.arm.isin(mech)))
                & ~summary.signal.isin(list(NO_NOISE)) & summary.hi.notna()]   # a NaN floor is none
    fixed = summary[summary.signal.isin(list(NO_NOISE))][["signal", "where"]].drop_duplicates()
    fixed = fixed.assign(floor_hi=0.0, floor_arm=fixed.signal.map(NO_NOISE))
    if f.empty:
        return fixed.reset_index(drop=True) if len(fixed) else pd.DataFrame(
            columns=["signal", "where", "floor_hi", "floor_arm"])
    idx = f.groupby(["signal", "where"])["hi"].idxmax()
    out = f.loc[idx, ["signal", "where", "hi", "arm"]].rename(columns={"hi": "floor_hi", "arm": "floor_arm"})
    return pd.concat([out, fixed], ignore_index=True)


@dataclass(frozen=True)
class Design:
    """What the arms are, as the verdict sees them."""
    baseline: str                        # the arm every signal is measured against (outcome 0)
    arms: dict[str, frozenset]           # candidate arm -> the factors (toggles, patches) it holds
    factors: list[str]                   # what attribution ranges over
    floors: list[str]                    # arms that are noise floors, not candidates
    added_to: frozenset | None = None    # base: every base + t arm gives t an added_to_base effect
    mechanism_floors: list[str] | None = None   # floors that are noise for mechanism signals

    def noise_for_mechanism(self) -> list[str]:
        """The floors mechanism signals are judged against: given, or signals.mechanism_floors."""
        if self.mechanism_floors is not None:
            return self.mechanism_floors
        return mechanism_floors(self.floors)


def attribute_signals(sig: pd.DataFrame, design: Design, boot: Bootstrap) -> pd.DataFrame:
    """Attribution (one-at-a-time, leave-one-out, Shapley where the design allows) of
    every signal at every place, with paired bootstrap CIs over prompts. With `base` =
    design.added_to (e.g. the engine arm's toggles), every arm that is base plus one toggle t also gives t an
    `added_to_base` effect: signal(base + t) - signal(base); likewise every arm under a
    schedule S that is another arm under S plus t (golden@S + t) an `under_schedule` one."""
    rows, base = [], design.added_to
    for (s, w), grp in sig.groupby(["signal", "where"], sort=False):
        table = outcome_matrix(grp.rename(columns={"value": "kld"}), design.arms, design.baseline)
        if len(table) < 2:
            continue
        for r in attribute(design.factors, table, boot.n_boot, boot.seed):
            rows.append({"signal": s, "where": w, **r})
        if base and base in table:
            rows += _added(table, base, (s, w), "added_to_base", boot)
        for ctx in [k for k in table if any(f.startswith(SCHEDULE_FACTOR) for f in k) and k != base]:
            rows += _added(table, ctx, (s, w), "under_schedule", boot)
    return pd.DataFrame(rows, columns=ATTRIBUTION_COLUMNS)


# attribution rows; `schedule`: the schedule(s) an under_schedule effect was measured under;
# `vs_oneshot*`: that effect minus the same toggle's one-shot effect (paired, with its CI)
ATTRIBUTION_COLUMNS = ["signal", "where", "toggle", "method", "value", "lo", "hi", "schedule",
                       "vs_oneshot", "vs_oneshot_lo", "vs_oneshot_hi"]

# a factor that is a schedule (fidelity.ab.design.schedule_factor): arms under it are
# compared with golden under it, so a serving bug is measured where it can act
SCHEDULE_FACTOR = "@"


def _added(table, ctx: frozenset, place: tuple[str, str], method, boot: Bootstrap) -> list[dict]:
    """Effect of t added to the arm `ctx`: signal(ctx + t) - signal(ctx), per t present.
    Under a schedule, also how it differs from the same effect one-shot (ctx without its
    schedule), paired over prompts: `vs_oneshot` with its interval, NaN when the one-shot
    arms were not run. `place`: (signal, where)."""
    (s, w), n_boot, seed = place, boot.n_boot, boot.seed
    rows = []
    context = ", ".join(sorted(f[len(SCHEDULE_FACTOR):] for f in ctx if f.startswith(SCHEDULE_FACTOR)))
    plain = frozenset(f for f in ctx if not f.startswith(SCHEDULE_FACTOR))
    for t in sorted(next(iter(k - ctx)) for k in table if k > ctx and len(k - ctx) == 1):
        pair = {frozenset(): table[ctx], frozenset({t}): table[ctx | {t}]}
        for r in attribute([t], pair, n_boot, seed):
            if r["method"] == "one_at_a_time":        # (leave-one-out and Shapley equal it here)
                row = {"signal": s, "where": w, **r, "method": method, "schedule": context}
                if context and plain in table and plain | {t} in table:
                    extra = (table[ctx | {t}] - table[ctx]) - (table[plain | {t}] - table[plain])
                    m, lo, hi = bootstrap_mean_ci(extra, n_boot, seed)
                    row.update(vs_oneshot=m, vs_oneshot_lo=lo, vs_oneshot_hi=hi)
                rows.append(row)
    return rows


def direct_effects(pair_sig: pd.DataFrame, arm_sets: dict[str, frozenset], base: frozenset,
                   n_boot: int, seed: int) -> pd.DataFrame:
    """Effect of toggle t measured directly between the arms base + t and base (signals of
    one against the other, e.g. KLD(engine ‖ engine + bug)): no difference of two noisy
    distances to golden. Rows like attribute_signals' with method `vs_base`."""
    rows = []
    for (arm, s, w), grp in pair_sig.groupby(["arm", "signal", "where"], sort=False):
        extra = arm_sets.get(arm, frozenset()) - base
        if len(extra) != 1 or not base < arm_sets[arm]:
            continue
        m, lo, hi = bootstrap_mean_ci(grp.sort_values("prompt").value.to_numpy(float), n_boot, seed)
        rows.append({"signal": s, "where": w, "toggle": next(iter(extra)), "method": "vs_base",
                     "value": m, "lo": lo, "hi": hi})
    return pd.DataFrame(rows, columns=["signal", "where", "toggle", "method", "value", "lo", "hi"])


def with_multiples(t: pd.DataFrame) -> pd.DataFrame:
    """One multiple per finding: x_floor = the point estimate over its floor (what a headline
    quotes), x_floor_lo = the interval's lower end over it (above 1: it clears; findings are
    ranked by it). Floors of 0 count as the signal's FLOOR_EPS."""
    floor = np.maximum(t.floor_hi.astype(float), t.signal.map(FLOOR_EPS).fillna(1e-9))
    return t.assign(x_floor=t.value / floor, x_floor_lo=t.lo / floor)
