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


def test_wilson_exact_small_case_z2():
    # 1 of 4 at z = 2: centre (1/4 + 4/8) / (1 + 4/4) = 3/8, half sqrt(3/64 + 4/64) = sqrt(7)/8
    lo, hi = wilson(1, 4, z=2.0)
    assert lo == pytest.approx((3 - math.sqrt(7)) / 8, rel=1e-12)
    assert hi == pytest.approx((3 + math.sqrt(7)) / 8, rel=1e-12)


def test_wilson_fractional_k_partial_credit():
    # 2.5 of 10 (partial credit): p = .25, z^2 = 3.841459; centre .319383, half .238436
    z = 1.959963984540054
    den = 1 + z * z / 10
    mid = (0.25 + z * z / 20) / den
    half = z * math.sqrt(0.25 * 0.75 / 10 + z * z / 400) / den
    lo, hi = wilson(2.5, 10)
    assert (lo, hi) == pytest.approx((mid - half, mid + half), rel=1e-12)
    assert lo == pytest.approx(0.080948, abs=1e-6) and hi == pytest.approx(0.557819, abs=1e-6)
    # between its integral neighbours, which take the scipy path
    assert wilson(2, 10)[0] < lo < wilson(3, 10)[0] and wilson(2, 10)[1] < hi < wilson(3, 10)[1]


@pytest.mark.parametrize("z", [1.0, 1.6448536269514722, 1.959963984540054, 2.5758293035489004])
def test_wilson_scipy_path_matches_closed_form(z):
    from needle.stats import _wilson_closed_form
    for n in range(1, 41):
        for k in range(n + 1):
            assert wilson(k, n, z) == pytest.approx(_wilson_closed_form(k, n, z), abs=1e-12)


def test_wilson_edges_and_input_types():
    assert wilson(0, 7)[0] == 0.0 and wilson(7, 7)[1] == 1.0
    np = pytest.importorskip("numpy")
    assert wilson(np.int64(3), 7) == pytest.approx(wilson(3, 7), abs=1e-15)
    assert wilson(3.0, 7) == wilson(3, 7)
    assert wilson(True, 1) == wilson(1, 1)
    with pytest.raises(ValueError):
        wilson(11, 10)
    with pytest.raises(ValueError):
        wilson(-1, 10)


def test_binomial_exact_against_math_comb():
    for d in range(1, 40):
        for b in range(d + 1):
            m = min(b, d - b)
            want = min(1.0, 2 * sum(math.comb(d, i) for i in range(m + 1)) / 2 ** d)
            assert binom_two_sided(b, d) == pytest.approx(want, rel=1e-12), (b, d)
    assert binom_two_sided(0, 0) == 1.0


def test_mcnemar_exact_below_25_uses_binomial_tail():
    # 24 discordant (3 vs 21): exact; 2 * (C(24,0)+C(24,1)+C(24,2)+C(24,3)) / 2^24
    a = [True] * 3 + [False] * 21 + [False] * 6
    b = [False] * 3 + [True] * 21 + [False] * 6
    m = mcnemar(a, b)
    assert m.test == "exact"
    assert m.p_value == pytest.approx(2 * (1 + 24 + 276 + 2024) / 2 ** 24, rel=1e-12)


def test_chi2_cc_known_values():
    from needle.stats import chi2_cc
    # 1-df chi-square survival is erfc(sqrt(x / 2)); 121 vs 59: x = 61^2/180 = 20.6722
    assert chi2_cc(121, 59) == pytest.approx(5.450094825427123e-06, rel=1e-9)
    assert chi2_cc(25, 10) == pytest.approx(0.017960, abs=2e-6)           # x = 5.6
    for b, c in [(13, 12), (30, 0), (40, 20), (100, 130)]:
        x = (abs(b - c) - 1) ** 2 / (b + c)
        assert chi2_cc(b, c) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-12)
    m = mcnemar([True] * 121 + [False] * 59, [False] * 121 + [True] * 59)
    assert m.test == "chi2-cc" and m.p_value == pytest.approx(5.450094825427123e-06, rel=1e-9)
