"""Exact paired tests for the verdict's binary signals (the needle's indexer entry lost).

A 0/1 outcome per prompt bootstrapped over 3-9 prompts always has an interval that
includes 0, so a bug that drops the needle's entry in 2 of 9 prompts went unnamed. Here
every trial counts -- prompts x CSA layers, pooled -- and two arms that differ by one
factor are compared on the same trials with McNemar's exact test: of the trials where
exactly one of them loses the entry, does the arm with the factor lose it more often than
chance (one-sided binomial, p = 1/2)? An arm one factor away from the baseline is
compared with each mechanism floor instead, and must beat every one of them."""
from __future__ import annotations

from typing import NamedTuple

import pandas as pd
from scipy import stats

BINARY = ("needle_lost",)
ALPHA = 0.05
POOLED = "CSA layers pooled"
COLUMNS = ["signal", "where", "toggle", "method", "value", "lo", "hi", "b", "c", "n", "p_value",
           "vs"]


def exact_tests(sig: pd.DataFrame, arms: dict[str, frozenset], floors: list[str]) -> pd.DataFrame:
    """One row per (binary signal, pooled place, toggle, comparison). `sig`: the verdict's
    signals (signals.COLUMNS) with 0/1 values; `arms`: candidate arm -> factors; `floors`:
    the floors a one-factor arm is compared with (noise for this signal)."""
    rows = []
    for signal in BINARY:
        s = sig[sig.signal == signal]
        if s.empty:
            continue
        for place, trials in _pooled(s).items():
            rows += _compare_all(signal, place, trials, arms, floors)
    return pd.DataFrame(rows, columns=COLUMNS)


def _pooled(s: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per-layer places pooled into one set of trials (prompt, layer); a length group's
    places (`layer i @ L511`) pooled separately."""
    suffix = s["where"].str.extract(r"( @ .*)$")[0].fillna("")
    out = {}
    for sfx, grp in s.groupby(suffix, sort=False):
        out[POOLED + sfx] = grp.assign(trial=grp.prompt + " | " + grp["where"])
    return out


def _compare_all(signal, place, trials, arms, floors) -> list[dict]:
    by_arm = {a: g.set_index("trial").value.astype(bool) for a, g in trials.groupby("arm")}
    rows = []
    for arm, factors in arms.items():
        if arm not in by_arm:
            continue
        if len(factors) == 1:
            tests = [(paired(by_arm[arm], by_arm[f]), f) for f in floors if f in by_arm]
            if tests:
                worst = max(tests, key=lambda t: t[0].p)        # must beat every floor: the largest p
                rows.append(_row(signal, place, next(iter(factors)), "exact_vs_floors", *worst))
        for other, fewer in arms.items():
            if other in by_arm and fewer < factors and len(factors - fewer) == 1:
                t = next(iter(factors - fewer))
                rows.append(_row(signal, place, t, f"exact_vs_{other}",
                                 paired(by_arm[arm], by_arm[other]), other))
    return rows


class PairedTest(NamedTuple):
    """One exact paired test's counts and p-value, kept together from paired() to its row."""
    b: int          # trials where x only
    c: int          # trials where y only
    n: int          # trials both have
    p: float        # exact one-sided McNemar p-value


def paired(x: pd.Series, y: pd.Series) -> PairedTest:
    """(b, c, n, p): on the trials both have, b = x only, c = y only; p = exact one-sided
    McNemar P(B >= b | b + c discordant, p = 1/2)."""
    x, y = x.align(y, join="inner")
    b, c = int((x & ~y).sum()), int((~x & y).sum())
    p = float(stats.binom.sf(b - 1, b + c, 0.5)) if b + c else 1.0
    return PairedTest(b, c, len(x), p)


def _row(signal, place, toggle, method, test: PairedTest, vs) -> dict:
    """The difference in rate (b - c) / n with an exact interval conditional on the b + c
    discordant trials (Clopper-Pearson on b / (b + c))."""
    b, c, n, p = test
    d = b + c
    if d:
        ci = stats.binomtest(b, d).proportion_ci(0.95, method="exact")
        lo, hi = d / n * (2 * ci.low - 1), d / n * (2 * ci.high - 1)
    else:
        lo = hi = 0.0
    return {"signal": signal, "where": place, "toggle": toggle, "method": method,
            "value": (b - c) / n if n else 0.0, "lo": lo, "hi": hi, "b": b, "c": c, "n": n,
            "p_value": p, "vs": vs}


def detectable(c: int, alpha: float = ALPHA) -> int:
    """The fewest losses an arm must have where its comparator has none (with `c` the other
    way) for the exact test to name it: the smallest b with P(B >= b | b + c, 1/2) < alpha."""
    b = 1
    while stats.binom.sf(b - 1, b + c, 0.5) >= alpha:
        b += 1
    return b


def power_sentence(rows: pd.DataFrame) -> str:
    """What this run's exact tests could see, for selection faults whose only outcome is a
    lost needle entry on a few prompts: for each one-factor arm that lost entries the floors
    kept but too few to name, the count it would need and about how many more prompts would
    bring it there if its rate holds; else the smallest loss this run names at all."""
    r = rows[(rows.method == "exact_vs_floors") & (rows.signal == "needle_lost")]
    if r.empty:
        return ""
    near = r[(r.b > r.c) & ~clears(r)]
    parts = []
    for x in near.itertuples():
        need = detectable(x.c)
        scale = -(-need // max(x.b - x.c, 1))                     # ceil: prompts x this many
        parts.append(f"`{x.toggle}` lost the needle's entry in {x.b} of {x.n} (prompt, CSA layer) trials "
                     f"where the floors kept it ({x.c} the other way, exact p = {x.p_value:.2g}): this run "
                     f"names {need} or more; about {scale}x the prompts (--reps) would, if the rate holds")
    if parts:
        return "Selection losses too few to name: " + "; ".join(parts) + "."
    if clears(r).any():                       # a selection fault is named: its row says enough
        return ""
    n = int(r.n.max())
    return (f"Selection power: a toggle is named for losing the needle's indexer entry when it loses it in "
            f"{detectable(0)} or more of the {n} (prompt, CSA layer) trials where the floors keep it.")


def clears(rows: pd.DataFrame) -> pd.Series:
    """Named by the exact test: more losses with the factor than without, p < ALPHA."""
    return (rows.p_value < ALPHA) & (rows.b > rows.c)
