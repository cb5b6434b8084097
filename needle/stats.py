"""Wilson score intervals and McNemar's paired test, computed with scipy.stats.

McNemar on the discordant pairs b (A right, B wrong) and c (A wrong, B right): exact
two-sided binomial test (`scipy.stats.binomtest`, p = 1/2) when b + c < 25 (the chi-square
approximation is poor there), otherwise chi-square with continuity correction, 1 degree
of freedom (`scipy.stats.chi2.sf`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats

EXACT_BELOW = 25
Z95 = 1.959963984540054


def _wilson_closed_form(k: float, n: int, z: float) -> tuple[float, float]:
    """Wilson's closed form (Newcombe 1998, method 3) for a real-valued k. Only used for
    fractional k (partial credit), which `scipy.stats.binomtest` rejects; for integral k it
    agrees with scipy to floating-point noise (tests/test_needle_stats.py checks this)."""
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def wilson(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (two-sided, normal quantile z);
    (nan, nan) when n == 0. k may be fractional for partial credit: scipy's binomtest needs
    an integer count, so a fractional k goes through the same formula written out."""
    if n <= 0:
        return (math.nan, math.nan)
    kf = float(k)
    if not 0 <= kf <= n:
        raise ValueError(f"k={k} outside [0, n={n}]")
    if not kf.is_integer():
        return _wilson_closed_form(kf, n, z)
    # proportion_ci takes a confidence level and turns it back into z = ndtri(0.5 + level/2)
    level = 1 - 2 * float(stats.norm.sf(z))
    ci = stats.binomtest(int(kf), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return (max(0.0, float(ci.low)), min(1.0, float(ci.high)))


@dataclass
class McNemar:
    n: int          # pairs
    a_only: int     # b: A correct, B not
    b_only: int     # c: B correct, A not
    p_value: float
    test: str       # "exact" | "chi2-cc" | "none"

    @property
    def delta(self) -> float:
        """Recall(A) - recall(B) over the pairs."""
        return (self.a_only - self.b_only) / self.n if self.n else math.nan


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial p for k of n under p = 1/2 (= 2 * P(X <= min(k, n-k)),
    capped at 1, by symmetry); 1.0 when n == 0."""
    if n == 0:
        return 1.0
    return float(stats.binomtest(int(k), int(n), p=0.5, alternative="two-sided").pvalue)


def chi2_cc(b: int, c: int) -> float:
    """McNemar chi-square with continuity correction, (|b - c| - 1)^2 / (b + c), 1 df: p."""
    return float(stats.chi2.sf((abs(b - c) - 1) ** 2 / (b + c), df=1))


def mcnemar(a_correct: list[bool], b_correct: list[bool]) -> McNemar:
    if len(a_correct) != len(b_correct):
        raise ValueError("paired lists differ in length")
    b = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    n = len(a_correct)
    d = b + c
    if d == 0:
        return McNemar(n, b, c, 1.0, "none")
    if d < EXACT_BELOW:
        return McNemar(n, b, c, binom_two_sided(b, d), "exact")
    return McNemar(n, b, c, chi2_cc(b, c), "chi2-cc")
