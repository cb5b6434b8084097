"""Wilson intervals and McNemar against hand-computed / published values."""
import math

import pytest

from needle.stats import binom_two_sided, mcnemar, wilson


@pytest.mark.parametrize("k,n,lo,hi", [
    # published Wilson 95% intervals (z = 1.96)
    (0, 10, 0.0, 0.2775),
    (5, 10, 0.2366, 0.7634),
    (8, 10, 0.4902, 0.9433),
    (10, 10, 0.7225, 1.0),
    (1, 2, 0.0945, 0.9055),
])
def test_wilson_published(k, n, lo, hi):
    a, b = wilson(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_wilson_by_hand_formula():
    # 3 of 20: p=.15, z^2=3.8415; centre (.15+.096037)/1.192073=.206395,
    # half 1.96*sqrt(.006375+.0024009)/1.192073=.154018
    lo, hi = wilson(3, 20)
    assert lo == pytest.approx(0.05238, abs=1e-4) and hi == pytest.approx(0.36041, abs=1e-4)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_binomial_exact_by_hand():
    assert binom_two_sided(1, 6) == pytest.approx(14 / 64)      # 2*(C(6,0)+C(6,1))/2^6
    assert binom_two_sided(0, 6) == pytest.approx(2 / 64)
    assert binom_two_sided(3, 6) == 1.0                          # capped
    assert binom_two_sided(2, 10) == pytest.approx(2 * (1 + 10 + 45) / 1024)


def test_mcnemar_exact_and_chi2():
    a = [True] * 1 + [False] * 5 + [True] * 4
    b = [False] * 1 + [True] * 5 + [True] * 4
    m = mcnemar(a, b)
    assert (m.n, m.a_only, m.b_only, m.test) == (10, 1, 5, "exact")
    assert m.p_value == pytest.approx(14 / 64)
    assert m.delta == pytest.approx((1 - 5) / 10)
    # 10 vs 25 discordant: chi2 = (|10-25|-1)^2/35 = 5.6, p = 0.017960 (chi2 sf, 1 df)
    a = [True] * 10 + [False] * 25 + [True] * 5
    b = [False] * 10 + [True] * 25 + [True] * 5
    m = mcnemar(a, b)
    assert m.test == "chi2-cc" and m.p_value == pytest.approx(0.017960, abs=2e-6)
    assert mcnemar([True, False], [True, False]).p_value == 1.0
