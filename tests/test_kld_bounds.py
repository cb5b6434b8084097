"""KL from partial distributions (fidelity/scores/bounds.py) against fp64 math on the whole
vocabulary: the coarse-grained bound never exceeds the true KL (either direction), equals
it when both sides report everything, the TV interval brackets the true TV, and top-1 /
Δp are exact."""
import math

import numpy as np
import pytest

from fidelity.scores.bounds import Known, compare


def _dist(rng, v, temp):
    x = rng.normal(size=v) * temp
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def _exact(lp, lq):
    p, q = np.exp(lp), np.exp(lq)
    return float(np.sum(p * (lp - lq))), float(np.sum(q * (lq - lp))), 0.5 * float(np.abs(p - q).sum())


def _top(lp, k, extra=()):
    ids = np.unique(np.concatenate([np.argsort(-lp)[:k], np.asarray(extra, int)]))
    return Known(ids, lp[ids])


@pytest.mark.parametrize("seed", range(6))
def test_bounds_hold_and_tighten(seed):
    rng = np.random.default_rng(seed)
    v = 200
    lp = _dist(rng, v, 2.0)
    lq = lp + rng.normal(size=v) * 0.3
    lq = lq - np.log(np.exp(lq).sum())
    kl, rkl, tv = _exact(lp, lq)
    full = compare(Known(np.arange(v), lp), Known(np.arange(v), lq), 7)
    assert full["kl_lb"] == pytest.approx(kl, rel=1e-9) and full["rkl_lb"] == pytest.approx(rkl, rel=1e-9)
    assert full["uncovered_p"] < 1e-12 and full["tv_lo"] == pytest.approx(tv, rel=1e-9)
    last = 0.0
    for k in (1, 5, 20, 80):
        c = compare(Known(np.arange(v), lp), _top(lq, k, [7]), 7)        # P full, Q top-k
        assert c["kl_lb"] <= kl + 1e-12 and c["rkl_lb"] <= rkl + 1e-12
        assert c["tv_lo"] - 1e-12 <= tv <= c["tv_hi"] + 1e-12
        assert c["kl_lb"] >= last - 1e-12                               # more ids, tighter
        last = c["kl_lb"]
        both = compare(_top(lp, k), _top(lq, k), None)                  # both top-k only
        assert both["kl_lb"] <= kl + 1e-12
        s = set(np.argsort(-lp)[:k]) & set(np.argsort(-lq)[:k])
        assert both["uncovered_p"] == pytest.approx(1 - sum(math.exp(lp[i]) for i in s), abs=1e-12)
    assert c["same_top1"] == (int(np.argmax(lp)) == int(np.argmax(lq)))
    assert c["dp"] == pytest.approx(math.exp(lq[7]) - math.exp(lp[7]), abs=1e-15)


def test_hand_computed_case():
    # P = (0.5, 0.3, 0.2), Q = (0.4, 0.4, 0.2); S = {0}: bound = .5 ln(.5/.4) + .5 ln(.5/.6)
    lp, lq = np.log([0.5, 0.3, 0.2]), np.log([0.4, 0.4, 0.2])
    c = compare(Known(np.array([0]), lp[:1]), Known(np.array([0]), lq[:1]), None)
    assert c["kl_lb"] == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6), abs=1e-15)
    assert c["uncovered_p"] == pytest.approx(0.5) and c["dp"] is None
    assert c["tv_lo"] == pytest.approx(0.1) and c["tv_hi"] == pytest.approx(0.6)
    # 0 log 0: the arm puts no mass where the baseline puts none
    z = compare(Known(np.array([0, 1]), np.log([1.0, 1e-300])), Known(np.array([0, 1]), np.log([1.0, 1e-300])), 0)
    assert z["kl_lb"] == 0.0 and z["dp"] == 0.0 and z["same_top1"]
