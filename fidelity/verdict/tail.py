"""The per-prompt tail: an arm that breaks a few prompts badly.

A bootstrap interval of the mean over 18 prompts starts near 0 when 16 of them are
untouched, so a bug that is wrong only at some lengths or positions (the field's worst
V4 bugs) went unnamed with an answer KLD 2000x its floor on two prompts. Here each
prompt is judged against what the floors reach on that same prompt:

- F_p, the largest value any floor arm reaches on prompt p (never below the floors' median
  over prompts; under a schedule, also the toggle's own one-shot value: judging_floors),
  and the arm's ratio r_p = V_p / F_p;
- a prompt is broken when r_p >= BROKEN (10x: far beyond the floors, not a wobble);
- the exact test: under "the arm is noise like the floors" a prompt's expected value is
  at most F_p, so by Markov's inequality P(r_p >= r) <= 1/r for a nonnegative signal,
  prompts independently. For the j-th largest ratio r_(j), P(r_(j) >= r) <= P(Bin(n, 1/r)
  >= j): the p-value of the j broken prompts. The smallest over j = 1..X (X broken),
  times X (Bonferroni over the j looked at), is the arm's p-value.

No assumption beyond nonnegativity and "a noise arm averages no more than the floors on
a prompt". An arm whose every prompt sits inside the floors has no broken prompt and is
never named; a single prompt must reach about n/ALPHA times its floor to be named alone."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from .signals import FLOOR_EPS, SCHEDULE_FACTOR

TAIL_SIGNALS = ("kld_mean", "kld_p99", "answer_kld", "top1_disagree")
BROKEN = 10.0
ALPHA = 0.05
METHOD = "tail"
COLUMNS = ["signal", "where", "toggle", "method", "value", "lo", "hi", "floor_hi", "floor_arm",
           "b", "n", "p_value", "schedule", "prompts", "worst"]


@dataclass(frozen=True)
class PromptFloors:
    """Each prompt's floor and the floor arm it came from, set beside an arm's values."""
    value: pd.Series                    # per prompt: the floor judging it (judging_floors)
    arm: pd.Series                      # per prompt: the floor arm holding it


def tail_tests(sig: pd.DataFrame, arms: dict[str, frozenset], floors: list[str],
               describe: dict[str, str] | None = None, serving: list[str] | None = None) -> pd.DataFrame:
    """One row per (arm with one toggle, tail signal): X = b broken prompts of n, value /
    hi the worst prompt's value, lo the least broken one's, floor_hi the largest floor
    among the broken prompts, p_value as in the module docstring; `prompts` names the
    broken prompts (with `describe[prompt]`, e.g. "511 tokens, needle at 70%"). Each
    prompt's floor is judging_floors'."""
    describe = describe or {}
    s = sig[sig.signal.isin(TAIL_SIGNALS) & (sig["where"] == "final logits")]
    rows = []
    for signal, grp in s.groupby("signal", sort=False):
        wide = grp.pivot_table(index="prompt", columns="arm", values="value", aggfunc="first")
        judged = judging_floors(wide, arms, floors, serving, signal)
        for arm, pf in judged.items():
            toggles = [f for f in arms[arm] if not f.startswith(SCHEDULE_FACTOR)]
            if len(toggles) != 1:
                continue
            v = wide[arm].dropna()
            rows.append(_row(signal, toggles[0], _schedule(arms[arm]), v,
                             PromptFloors(pf.value.reindex(v.index), pf.arm.reindex(v.index)), describe))
    return pd.DataFrame(rows, columns=COLUMNS)


def judging_floors(wide: pd.DataFrame, arms, floors: list[str], serving: list[str] | None,
                   signal: str) -> dict[str, PromptFloors]:
    """Per arm with values in `wide` (prompts x arms): each prompt's floor, the one
    definition the verdict's tail and the residue table share.

    A one-shot arm is judged against every floor. An arm under a schedule is judged against
    the `serving` floors (reduction and tie order, the golden's own schedule floor: the
    golden is exact under every schedule, so what separates t@S from it is t and the
    kernels' shapes, never QAT -- a property of the weights, the same on both sides), and
    against the same toggles' one-shot arm on that prompt when the run has it: a prompt
    breaks *under* the schedule only when the schedule makes it 10x worse than the toggle
    alone does, never because the serving floors are lower than QAT's. `arms`: names, or
    name -> factors (a schedule factor marks a scheduled arm)."""
    factors = arms if isinstance(arms, dict) else {a: frozenset() for a in arms}
    have = [f for f in floors if f in wide]
    if not have:
        return {}
    quiet = [f for f in serving or () if f in wide] or have
    by_kind = {False: prompt_floors(wide, have, signal), True: prompt_floors(wide, quiet, signal)}
    oneshot = {frozenset(f): a for a, f in factors.items() if not _schedule(f)}
    out = {}
    for arm, fs in factors.items():
        if arm not in wide:
            continue
        scheduled = bool(_schedule(fs))
        pf = PromptFloors(*by_kind[scheduled])
        alone = oneshot.get(frozenset(f for f in fs if not f.startswith(SCHEDULE_FACTOR)))
        if scheduled and alone in wide:
            own = wide[alone].fillna(0.0)
            worse = own > pf.value
            pf = PromptFloors(pf.value.where(~worse, own), pf.arm.where(~worse, alone))
        out[arm] = pf
    return out


def prompt_floors(wide: pd.DataFrame, floors: list[str], signal: str) -> tuple[pd.Series, pd.Series]:
    """Per prompt (rows of `wide`, one column per arm): the largest value any floor arm
    reaches and the floor arm holding it -- never below the floors' median over the run's
    prompts (one prompt's floor is one sample: near 0 it would make any change look large).
    Only when no floor moved anywhere (every floor arm bit-identical) is the floor the
    signal's FLOOR_EPS, labelled as the clamp it is."""
    fl = wide[floors]
    top, arm = fl.max(axis=1), fl.idxmax(axis=1)
    low = float(top.median()) if top.notna().any() else 0.0
    label = "floors' median over prompts"
    if not low > 0:
        moved = top[top > 0]
        low, label = ((float(moved.min()), "smallest floor measured") if len(moved) else
                      (FLOOR_EPS.get(signal, 1e-9), f"clamp {FLOOR_EPS.get(signal, 1e-9):.0e} (floors bit-identical)"))
    lifted = ~(top >= low)
    return top.where(~lifted, low), arm.astype(object).where(~lifted, label)


def broken(values: pd.Series, floor: pd.Series) -> pd.Series:
    """The one definition of a broken prompt, for the verdict and the residue table alike:
    the arm's value at least BROKEN times the prompt's floor (prompt_floors)."""
    return (values / floor.reindex(values.index)) >= BROKEN


def _schedule(factors: frozenset) -> str:
    return ", ".join(sorted(f[len(SCHEDULE_FACTOR):] for f in factors if f.startswith(SCHEDULE_FACTOR)))


def p_value(ratios: np.ndarray, n: int) -> float:
    """Markov-binomial p-value of the broken ratios (module docstring); 1 when none."""
    r = np.sort(ratios[ratios >= BROKEN])[::-1]
    if not len(r):
        return 1.0
    ps = [stats.binom.sf(j - 1, n, 1.0 / r[j - 1]) for j in range(1, len(r) + 1)]
    return float(min(1.0, min(ps) * len(r)))


def _row(signal, toggle, schedule, v: pd.Series, floors: PromptFloors, describe: dict) -> dict:
    floor, floor_arm = floors.value, floors.arm
    ratio = (v / floor).to_numpy(float)
    hit = v.index[broken(v, floor).to_numpy()]
    order = sorted(hit, key=lambda p: -float(v[p] / floor[p]))
    worst = order[0] if order else v.idxmax()
    lo = float(v[hit].min()) if len(hit) else float(v[worst])
    fhi = float(floor[hit].max()) if len(hit) else float(floor[worst])
    return {"signal": signal, "where": "final logits", "toggle": toggle, "method": METHOD,
            "value": float(v[worst]), "lo": lo, "hi": float(v[worst]), "floor_hi": fhi,
            "floor_arm": floor_arm.get(worst), "b": len(hit), "n": len(v),
            "p_value": p_value(ratio, len(v)), "schedule": schedule,
            "prompts": "; ".join(_prompt_words(p, v[p], floor[p], describe) for p in order),
            "worst": describe.get(worst, str(worst))}


def _prompt_words(p, value, floor, describe) -> str:
    where = f" ({describe[p]})" if p in describe else ""
    return f"{p}{where}: {value:.3g} vs floor {floor:.2g}"


def clears(rows: pd.DataFrame) -> pd.Series:
    """Named by the tail: at least one broken prompt and p < ALPHA."""
    return (rows.b > 0) & (rows.p_value < ALPHA)


def tail_words(r) -> str:
    """"breaks 2 of 18 prompts (worst: 511 tokens, needle at 70%): answer_kld 3.68 vs floor
    <= 0.0016 there (p <= 0.001)" -- p is the Markov-binomial bound, an upper bound."""
    return (f"breaks {int(r['b'])} of {int(r['n'])} prompts (worst: {r['worst']}): {r['signal']} "
            f"{r['value']:.3g} vs floor <= {r['floor_hi']:.2g} there (p <= {r['p_value']:.2g})")
