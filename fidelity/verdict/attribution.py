"""Attribution of a scalar outcome (e.g. mean final-logit KLD) to toggles.

`outcome(frozenset_of_toggles) -> array over prompts` is evaluated on a design of arms.
One-at-a-time: v({t}) − v(∅). Leave-one-out: v(all) − v(all∖{t}). Shapley: exact from the
full factorial (2^n arms, n ≤ 6), or permutation-sampled beyond. Confidence intervals
come from a bootstrap over prompts: the same resampled prompt set is used for every arm,
so the CI of a difference is paired."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np
import pandas as pd
from scipy import stats

Subset = frozenset


@dataclass(frozen=True)
class Bootstrap:
    """The bootstrap over prompts every interval of one judgement uses: resamples and seed."""
    n_boot: int = 1000
    seed: int = 0


def shapley_exact(names: list[str], value: Callable[[frozenset], float]) -> dict[str, float]:
    """φ_i = Σ_{S ⊆ N∖i} |S|!(n−|S|−1)!/n! · (v(S ∪ i) − v(S))."""
    n = len(names)
    phi = {}
    for i in names:
        others = [j for j in names if j != i]
        tot = 0.0
        for r in range(n):
            wgt = math.factorial(r) * math.factorial(n - r - 1) / math.factorial(n)
            for S in itertools.combinations(others, r):
                s = frozenset(S)
                tot += wgt * (value(s | {i}) - value(s))
        phi[i] = tot
    return phi


def shapley_sampled(names: list[str], value: Callable[[frozenset], float], n_perm: int,
                    seed: int = 0) -> dict[str, float]:
    """Permutation-sampling estimate: average marginal contribution along random orders.
    (Antithetic pairs: each sampled order is also used reversed.)"""
    rng = np.random.default_rng(seed)
    acc = {i: 0.0 for i in names}
    count = 0
    for _ in range(max(1, n_perm // 2)):
        order = list(rng.permutation(names))
        for o in (order, order[::-1]):
            s = frozenset()
            prev = value(s)
            for i in o:
                s = s | {i}
                cur = value(s)
                acc[i] += cur - prev
                prev = cur
            count += 1
    return {i: acc[i] / count for i in names}


def sampled_subsets(names: list[str], n_perm: int, seed: int = 0) -> list[frozenset]:
    """Every subset that `shapley_sampled` with the same arguments will ask for: the arms
    a run must evaluate beforehand."""
    seen: set[frozenset] = set()
    shapley_sampled(names, lambda s: (seen.add(s), 0.0)[1], n_perm, seed)
    return sorted(seen, key=lambda s: (len(s), sorted(s)))


def one_at_a_time(names, value) -> dict[str, float]:
    base = value(frozenset())
    return {i: value(frozenset({i})) - base for i in names}


def leave_one_out(names, value, full=None) -> dict[str, float]:
    """v(full) - v(full minus i) for each i in names (full defaults to all names)."""
    full = frozenset(names) if full is None else full
    top = value(full)
    return {i: top - value(full - {i}) for i in names}


def attribute(names: list[str], per_prompt: Mapping[frozenset, np.ndarray], n_boot: int = 1000,
              seed: int = 0, n_perm: int | None = None, ci: float = 0.95) -> list[dict]:
    """All three attributions with bootstrap CIs. `per_prompt[subset]` is the outcome per
    prompt (same prompt order for every subset). One-at-a-time and leave-one-out cover the
    toggles whose arms are present; Shapley needs its whole design. Returns tidy rows
    {toggle, method, value, lo, hi}."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in per_prompt.items()}
    n_prompts = len(next(iter(arrays.values())))
    full = frozenset(names)
    methods: dict[str, Callable] = {}
    oat = [i for i in names if frozenset({i}) in arrays]
    if frozenset() in arrays and oat:
        methods["one_at_a_time"] = lambda v: one_at_a_time(oat, v)
    # with one factor, leave-one-out is one-at-a-time under another name: not repeated
    loo = [i for i in names if full - {i} in arrays and full != {i}]
    if full in arrays and loo:
        methods["leave_one_out"] = lambda v: leave_one_out(loo, v, full)
    # with one factor Shapley's share is one-at-a-time's value too: a design of one endpoint
    # or one toggle is said as what it is (its own signal), not as a share
    several = len(names) >= 2
    if several and len(names) <= 6 and all(frozenset(s) in arrays for r in range(len(names) + 1)
                                           for s in itertools.combinations(names, r)):
        methods["shapley"] = lambda v: shapley_exact(names, v)
    elif several and n_perm and all(s in arrays for s in sampled_subsets(names, n_perm, seed)):
        methods["shapley"] = lambda v: shapley_sampled(names, v, n_perm, seed)

    def evaluate(idx):
        means = {k: float(a[idx].mean()) for k, a in arrays.items()}
        return {m: f(means.__getitem__) for m, f in methods.items()}

    point = evaluate(np.arange(n_prompts))
    # Paired bootstrap by hand: scipy.stats.bootstrap wants one scalar statistic per call.
    rng = np.random.default_rng(seed)
    boots = [evaluate(rng.integers(0, n_prompts, n_prompts)) for _ in range(n_boot)]
    a = (1 - ci) / 2
    rows = []
    for m in methods:
        for i in point[m]:
            samples = np.array([b[m][i] for b in boots])
            rows.append({"toggle": i, "method": m, "value": point[m][i],
                         "lo": float(np.quantile(samples, a)), "hi": float(np.quantile(samples, 1 - a))})
    return rows


def bootstrap_mean_ci(x: Iterable[float], n_boot: int = 1000, seed: int = 0, ci: float = 0.95):
    """(mean, lo, hi): percentile bootstrap CI of the mean (scipy.stats.bootstrap, n_boot
    resamples drawn from default_rng(seed)). A single value is its own interval."""
    x = np.asarray(list(x), dtype=np.float64)
    if len(x) == 1:                      # scipy needs two observations; every resample is x
        return float(x[0]), float(x[0]), float(x[0])
    # random_state (not rng, added in scipy 1.15) keeps the scipy>=1.11 floor working
    res = stats.bootstrap((x,), np.mean, n_resamples=n_boot, confidence_level=ci,
                          method="percentile", vectorized=True,
                          random_state=np.random.default_rng(seed))
    return float(x.mean()), float(res.confidence_interval.low), float(res.confidence_interval.high)


def prompt_outcomes(kld: pd.DataFrame, group: str | None = None, phase: str = "prefill") -> pd.DataFrame:
    """Outcome per (arm, prompt): mean final-logit KLD over positions (optionally one group)."""
    d = kld[kld.phase == phase]
    if group is not None:
        d = d[d.group == group]
    return d.groupby(["arm", "prompt"], as_index=False)["kld"].mean()


def outcome_matrix(outcomes: pd.DataFrame, arms_to_sets: dict[str, frozenset],
                   golden: str) -> dict[frozenset, np.ndarray]:
    """{toggle subset: per-prompt outcome array} for attribution; golden's outcome is 0."""
    prompts = sorted(outcomes.prompt.unique())
    table = {frozenset(): np.zeros(len(prompts))}
    for arm, s in arms_to_sets.items():
        if arm == golden:
            continue
        v = outcomes[outcomes.arm == arm].set_index("prompt")["kld"].reindex(prompts)
        if v.notna().all():
            table[frozenset(s)] = v.to_numpy(dtype=float)
    return table
