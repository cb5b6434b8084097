"""The verdict as a reader sees it, shared by the ab, kld and engines reports: the headline
(one sentence: what broke, where, how much against its floor), the signals board (each
arm's signals over their floors) and the suspects (each factor's strongest signal against
its floor, and which kind of finding it is)."""
from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .findings import _how_much, _layers
from .signals import MECHANISM_WHAT, QAT_FLOOR, SCHEDULE_FACTOR, with_multiples
from .tail import BROKEN
from .tail import METHOD as TAIL


# what a suspect's row is, in the words of the verdict (judge.verdict): an outcome finding
# names the toggle; a mechanism finding says what it changes inside, outcome within floors
OUTCOME, BOTH, MECHANISM_ONLY, NEITHER = ("outcome (named)", "outcome (named) + mechanism",
                                          "mechanism only", "below floors")
BELOW_TAIL = f"one prompt above its floor, below the {BROKEN:g}x bar"   # a tail row: x_floor is one prompt's
SUSPECTS_CAPTION = (f"Each toggle's strongest signal: value (95% CI) against the highest floor for that "
                    f"signal and place; x_floor = value / floor (the multiple the headline quotes), "
                    f"x_floor_ci_low = ci_low / floor (above 1: the interval clears the floor). Finding: \"{OUTCOME}\" = the verdict names it (an outcome signal's "
                    f"interval clears its floor; that outcome row is shown); \"{MECHANISM_ONLY}\" = it changes "
                    f"what the model selects inside (indexer picks, experts) beyond the floors that are noise "
                    f"for that, while the outcome stays within its floors; \"{NEITHER}\" = neither; "
                    f"\"{BELOW_TAIL}\" = a tail row (method tail: one prompt's value against that prompt's floor) "
                    f"whose multiple is above 1 but under the bar at which a prompt is broken.")


def suspects(verdict_table: pd.DataFrame, limit: int = 8) -> pd.DataFrame:
    """Each toggle's strongest signal against its floor, ranked as the verdict reads them:
    toggles the outcome names first (their strongest outcome row, the one the verdict
    quotes), then mechanism-only ones, then the rest; `finding` says which kind, so a
    mechanism finding never reads as a named culprit."""
    if verdict_table.empty:
        return verdict_table
    v = with_multiples(verdict_table)          # recomputed: a stored table may predate x_floor_lo
    if "kind" not in v:
        v["kind"] = "outcome"
    v["clears"] = v["clears"].astype(bool)
    outcome = set(v.toggle[v.clears & (v.kind == "outcome")])
    mechanism = set(v.toggle[v.clears & (v.kind == "mechanism")])
    tier = np.where(v.toggle.isin(outcome), np.where(v.clears & (v.kind == "outcome"), 3, 0),
                    np.where(v.toggle.isin(mechanism), v.clears.astype(int) * 2, 1))
    v["rank"] = tier * 1e9 + v["x_floor_lo"].replace(np.inf, 1e8).fillna(0).clip(upper=1e8)
    best = v.sort_values("rank", ascending=False).drop_duplicates("toggle").head(limit)
    finding = [BOTH if t in outcome and t in mechanism else OUTCOME if t in outcome
               else MECHANISM_ONLY if t in mechanism
               else BELOW_TAIL if m == TAIL and x > 1 else NEITHER        # a tail row above 1x: not "below floors"
               for t, m, x in zip(best.toggle, best.method, best.x_floor.fillna(0))]
    return pd.DataFrame({"toggle": best.toggle, "finding": finding, "signal": best.signal,
                         "where": best["where"], "method": best.method, "value": best.value,
                         "ci_low": best.lo, "ci_high": best.hi, "floor": best.floor_hi,
                         "x_floor": best.x_floor, "x_floor_ci_low": best.x_floor_lo}).reset_index(drop=True)


def named_suspects(sus: pd.DataFrame) -> pd.DataFrame:
    """The suspects the outcome verdict names."""
    return sus[sus.finding.isin([OUTCOME, BOTH])] if len(sus) else sus


def signal_ratios(sig_summary: pd.DataFrame, verdict: pd.DataFrame, arms: list[str]) -> pd.DataFrame:
    """Arm × "signal @ place": mean / highest floor's upper bound. NaN where there is
    nothing to compare (no floor for that place, or 0 against a 0 floor); inf where the
    floor is 0 and the arm is not."""
    fl = verdict.drop_duplicates(["signal", "where"]).set_index(["signal", "where"])["floor_hi"] \
        if len(verdict) else pd.Series(dtype=float)
    d = sig_summary[sig_summary.arm.isin(arms)].copy()
    d["col"] = d.signal + " @ " + d["where"].str.replace("final logits", "logits")
    floor = np.asarray(d.set_index(["signal", "where"]).index.map(lambda k: fl.get(k, np.nan)), float)
    mean = d["mean"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(floor > 0, mean / floor, np.where(mean > 0, np.inf, np.nan))
    d["ratio"] = np.where(np.isnan(floor), np.nan, ratio)
    piv = d.pivot_table(index="arm", columns="col", values="ratio", aggfunc="first", dropna=False)
    return piv.reindex([a for a in arms if a in piv.index])


def signal_board(sig_summary: pd.DataFrame, verdict: pd.DataFrame, arms: list[str], floors=()):
    """Arm × (signal, place) heat map of mean / highest floor's upper bound: an arm's cell is
    white within the floor and red by how many times above it (log scale, 100x and beyond
    darkest); a floor's row is in greys (its own size against the highest floor: the bar, never
    a finding colour); light grey hatched where there is no data (or 0 against a 0 floor), so
    "nothing to say" never looks like "far below the floor"; crossed where the arm differs and
    every floor is exactly 0 (bit-identical repeats: no multiple exists). The board is a page's lead plot,
    shown at its own size: labels at 10 pt, the signals named above the rows (on the first
    screen however many arms). `floors`: arms that are floors by their role, not their name
    (a served golden in a spec: what serving alone moves)."""
    piv = signal_ratios(sig_summary, verdict, arms)
    is_floor = [is_floor_arm(a) or a in floors for a in piv.index]      # a row per arm, in order
    r = piv.to_numpy(dtype=float)
    floor_row = np.array(is_floor, bool)[:, None]
    zero = np.isinf(r)                    # a floor of exactly 0 divides nothing: crossed, not "∞× above"
    under = np.ma.masked_invalid(np.where(floor_row & ~zero, np.log10(r.clip(1e-2, 1e2)), np.nan))
    z = np.ma.masked_invalid(np.where(floor_row | zero, np.nan, np.log10(r.clip(1.0, 1e4))))
    cmap = plt.get_cmap("Reds").with_extremes(bad=(0, 0, 0, 0))
    with plt.rc_context({"font.size": 10}):
        rows = max((len(str(a)) for a in piv.index), default=8)       # labels get their room
        cols = max((len(str(c)) for c in piv.columns), default=8)
        per_row = 0.32 if len(piv) <= 12 else 0.25
        fig, ax = plt.subplots(figsize=(1.6 + 0.5 * piv.shape[1] + 0.08 * rows,
                                        1.0 + per_row * len(piv) + 0.06 * cols))
        ax.imshow(under, aspect="auto", cmap=plt.get_cmap("Greys").with_extremes(bad="#e6e6e6"), vmin=-3, vmax=2)
        for mask, hatch, edge in ((np.isnan(r), "///", "#bbbbbb"), (zero, "xx", "#888888")):
            for i, j in zip(*np.nonzero(mask)):
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch=hatch, edgecolor=edge, lw=0))
        im = ax.imshow(z, aspect="auto", cmap=cmap, vmin=0, vmax=2)
        ax.set_yticks(range(len(piv)), [floor_label(a, f) for a, f in zip(piv.index, is_floor)], fontsize=10)
        for tick, f in zip(ax.get_yticklabels(), is_floor):
            if f:                         # a floor is the bar, not a finding: said on its row
                tick.set_color("#555555")
                tick.set_fontstyle("italic")
        floor_rows = [i for i, f in enumerate(is_floor) if f]
        if floor_rows and len(floor_rows) < len(piv) and floor_rows == list(range(len(floor_rows))):
            ax.axhline(len(floor_rows) - 0.5, color="black", linewidth=1.2)
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        ax.set_xticks(range(piv.shape[1]), piv.columns, rotation=40, ha="left", rotation_mode="anchor",
                      fontsize=10)
        ax.set_xlabel("signal @ place (hatched: no data or 0 vs 0; crossed: differs where every floor is exactly 0, "
                      "no noise to scale it by; italic grey rows: the floors themselves)")
        cb = fig.colorbar(im, ax=ax, label="mean / highest floor (white: within it)",
                          shrink=min(1.0, 0.35 + 0.07 * len(piv)), ticks=[0, 1, 2])
        cb.ax.set_yticklabels(["≤1×", "10×", "≥100×"])
        fig.tight_layout()
    return fig


def is_floor_arm(arm) -> bool:
    """A floor: the golden's (floor:...), one around a twin (twin~floor:...), or an engine's
    own repeat (engine~repeat)."""
    return str(arm).startswith("floor:") or "~floor:" in str(arm) or str(arm).endswith("~repeat")


def floor_label(arm, floor: bool | None = None) -> str:
    """A board row's label: floor arms say they are floors, the QAT one which floor it is
    (red on its row is the QAT simulation's own size against the other floors, not a bug).
    `floor`: whether the arm is a floor, when its role says so and not its name."""
    if str(arm) == QAT_FLOOR:
        return f"{arm} (QAT floor)"
    return f"{arm} (floor)" if (is_floor_arm(arm) if floor is None else floor) else str(arm)


# each signal in a few words, for the headline (SIGNALS has the full definitions)
SHORT = {"kld_mean": "mean final-logit KLD", "kld_p99": "p99 final-logit KLD", "answer_kld": "KLD at the answer",
         "late_kld_excess": "KLD growth along the context", "topk_loss": "indexer top-k loss",
         "needle_lost": "needle entry lost", "expert_disagree": "expert-set disagreement",
         "top1_disagree": "top-1 disagreement"}


def place_words(where: str) -> str:
    """"final logits @ L511" -> " on the 511-token prompts"; "layer 1" -> " at layer 1"
    (the final logits are where every outcome signal is read: not repeated)."""
    base, _, group = str(where).partition(" @ ")
    words = f" at {base}" if base.startswith("layer") else "" if base == "final logits" else f" at {base}"
    m = re.fullmatch(r"L(\d+)", group)
    return words + (f" on the {m.group(1)}-token prompts" if m else f" on the {group} prompts" if group else "")


def headline(v: dict, first_divergence=None, sets: dict | None = None) -> str:
    """The verdict in one sentence: the culprit the outcome names (signal, place, value
    against its floor, where it first departs); else the strongest mechanism finding; else
    the strongest departure; else a small but certain one (below the bar, above its floor on
    every prompt); else that nothing moves. Read from the verdict dict alone
    (judge.verdict, findings.with_departures), so the page can never say more than it."""
    caution = " Caution: too few prompts for the intervals to mean much." if v.get("few_prompts") else ""
    if v.get("named"):
        return _named_headline(v["named"], first_divergence, sets) + caution
    if v.get("mechanism"):
        return mechanism_headline(v["mechanism"]) + caution
    deps = sorted((d for d in v.get("departures") or [] if not d.get("below_bar")), key=lambda d: -d["ratio"])
    if deps:
        d = deps[0]
        return (f"No toggle changes the outcome or the mechanism beyond its floors; {d['arm']} departs "
                f"first at layer {d['layer']} `{d['tap']}` ({d['phase']}), {_times(d['ratio'])} the "
                f"reduction-order floor.{caution}")
    if v.get("small_certain"):                  # below the bar, above the floor on every prompt
        d = max(v["small_certain"], key=lambda d: d["ratio"])
        st = d["steady"]
        return (f"No toggle changes the outcome beyond its floors; small but certain: {d['arm']} departs "
                f"{_times(d['ratio'])} the reduction-order floor at layer {d['layer']} `{d['tap']}` "
                f"({d['phase']}) on {st['above']}/{st['n']} prompts (sign test p = {st['p']:.2g}).{caution}")
    if "No attribution" in v.get("sentence", ""):
        return v["sentence"]
    return "No toggle changes the outcome or the mechanism beyond its floors." + caution


def _times(x: float) -> str:
    return "infinitely many times" if not np.isfinite(x) else f"{x:.3g}×"


def _named_headline(named: list[dict], fd, sets) -> str:
    c = named[0]
    under = f" under {c['schedule']}" if c.get("schedule") else ""
    if c["method"] == TAIL and "tail" in c:
        t = c["tail"]
        how = (f"breaks {int(t['b'])} of {int(t['n'])} prompts{under}: {SHORT.get(t['signal'], t['signal'])} "
               f"{t['value']:.3g} vs a floor of at most {t['floor_hi']:.3g} (worst: {t['worst']})")
    else:
        lo = f", {c['lo'] / c['floor_hi']:.3g}× at its 95% interval's lower end" if c["floor_hi"] > 0 else ""
        vs = (f"{c['value'] / c['floor_hi']:.3g}× the highest floor ({c['floor_hi']:.3g}, {c['floor_arm']}){lo}"
              if c["floor_hi"] > 0 else f"where the highest floor ({c['floor_arm']}) is exactly 0")
        how = f"changes the outcome{under}: {_effect_words(c)} {c['value']:.3g}, {vs}"
    dep = _first_place(c["toggle"], fd, sets, c.get("schedule") or "")
    more = f" {len(named) - 1} more toggle(s) are named too." if len(named) > 1 else ""
    return f"{c['toggle']} {how}" + (f"; it first departs {dep}" if dep else "") + "." + more


def _effect_words(c: dict) -> str:
    """What the named value is, by its method: the arm's own signal (one at a time), or an
    effect -- a difference the toggle makes to another arm, not a KLD of its own."""
    what = f"{SHORT.get(c['signal'], c['signal'])}{place_words(c['where'])}"
    return {"added_to_base": f"added to the base arm, it raises {what} by",
            "under_schedule": f"added to golden under the same schedule, it raises {what} by",
            "leave_one_out": f"taken out of the arm holding every toggle, it lowers {what} by",
            "shapley": f"its Shapley share of {what} is"}.get(c["method"], f"{what} is")


def mechanism_headline(findings: list[dict]) -> str:
    f = findings[0]
    s = f["signals"][0]
    under = f" under {s['schedule']}" if s.get("schedule") else ""
    more = f"; {len(findings) - 1} more toggle(s) change the mechanism less" if len(findings) > 1 else ""
    return (f"Nothing changes the outcome beyond its floors; inside, {f['toggle']} changes "
            f"{MECHANISM_WHAT[s['signal']]} at {_layers(s['places'])}{under} ({_how_much(s)}){more}.")


def _first_place(toggle: str, fd, sets: dict | None, schedule: str = "") -> str:
    """Where the culprit itself first departs: from the arm it was added to (a --vs pair
    differing by it alone), else its own one-toggle arm from golden -- the arm under the
    finding's `schedule` first (a finding made under S is about that arm, not the one-shot
    one); "" when only arms holding other toggles too were compared (their first place may
    be another toggle's)."""
    rows = pd.DataFrame(fd) if fd is not None else pd.DataFrame()
    if rows.empty:
        return ""

    def factors(arm) -> frozenset:
        if arm == "golden":
            return frozenset()
        return frozenset(sets.get(arm, ())) if sets else frozenset(str(arm).split("@")[0].split(","))

    def toggles(arm) -> frozenset:
        return frozenset(f for f in factors(arm) if not f.startswith(SCHEDULE_FACTOR))
    own = rows[[toggles(a) - toggles(b) == {toggle} and toggles(b) <= toggles(a)
                for a, b in zip(rows.arm, rows.vs)]]
    if own.empty:
        return ""
    at = f"{SCHEDULE_FACTOR}{schedule}" if schedule else None
    same = [(at in factors(a)) if at else not (factors(a) - toggles(a)) for a in own.arm]
    r = own.assign(same=np.array(same, int), direct=(own.vs != "golden").astype(int)) \
        .sort_values(["same", "direct"], ascending=False).iloc[0]
    return (f"from {r.vs} at layer {r.layer} `{r.tap}` ({r.phase}), {_times(float(r.ratio))} "
            f"the reduction-order floor")
