"""Wilson score intervals and McNemar's paired test, in plain Python (math only).

McNemar on the discordant pairs b (A right, B wrong) and c (A wrong, B right): exact
two-sided binomial test when b + c < 25 (the chi-square approximation is poor there),
otherwise chi-square with continuity correction, 1 degree of freedom."""
from __future__ import annotations

import math
from dataclasses import dataclass

EXACT_BELOW = 25


def wilson(k: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (k may be fractional for
    partial credit); (nan, nan) when n == 0."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


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
    """Exact two-sided p for k of n under p = 1/2: 2 * P(X <= min(k, n-k)), capped at 1."""
    if n == 0:
        return 1.0
    m = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(m + 1)) / 2 ** n
    return min(1.0, 2 * tail)


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
    chi2 = (abs(b - c) - 1) ** 2 / d
    return McNemar(n, b, c, math.erfc(math.sqrt(chi2 / 2)), "chi2-cc")
