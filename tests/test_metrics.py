"""Metrics and attribution against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from fidelity.ab import metrics as M
from fidelity.verdict import attribution as A


def test_tensor_metrics_known_perturbation():
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    a = torch.tensor([3.0, 4.05], dtype=torch.float64)
    m = M.tensor_metrics(g, a)
    assert m["rel_l2"] == pytest.approx(0.01, rel=1e-9)
    assert m["sqnr_db"] == pytest.approx(40.0, rel=1e-9)          # 20·log10(5 / 0.05)
    dot, gg, aa = 9 + 4 * 4.05, 25.0, 9 + 4.05 ** 2
    assert m["deepgemm_diff"] == pytest.approx(1 - 2 * dot / (gg + aa), rel=1e-9)
    assert m["cosine"] == pytest.approx(dot / math.sqrt(gg * aa), rel=1e-12)
    assert m["max_abs"] == pytest.approx(0.05, rel=1e-6) and m["max_abs_at"] == [1]


def test_tensor_metrics_identical_bf16_and_nonfinite():
    g = torch.randn(4, 5).to(torch.bfloat16)
    m = M.tensor_metrics(g, g.clone())
    assert m["rel_l2"] == 0 and m["sqnr_db"] == math.inf and m["cosine"] == pytest.approx(1.0)
    bad = g.float().clone()
    bad[2, 3] = float("nan")
    m = M.tensor_metrics(g, bad)
    assert not m["finite"] and m["rel_l2"] == math.inf and m["max_abs_at"] == [2, 3]
    with pytest.raises(ValueError, match="shape mismatch"):
        M.tensor_metrics(g, g[:2])


def test_kld_of_known_distributions():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    k = M.kld_per_position(p.log(), q.log())
    assert float(k[0]) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-12)
    lm = M.logits_metrics(torch.cat([p, p]).log(), torch.cat([q, p]).log())
    assert lm["kld_mean"] == pytest.approx(float(k[0]) / 2, rel=1e-12)
    assert lm["kld_max"] == pytest.approx(float(k[0]), rel=1e-12)
    # golden top token is index 0 (tie -> first); arm puts 0.9 on it in row 0
    assert lm["dp_mean"] == pytest.approx((0.9 - 0.5) / 2, rel=1e-9)
    assert lm["same_top1"] == 1.0


def test_set_and_expert_metrics():
    g = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]])
    a = torch.tensor([[2, 1, 7, -1], [6, 5, 4, 3]])
    s = M.set_metrics(g, a)
    assert s["recall"] == pytest.approx((2 / 3 + 1) / 2)
    assert s["jaccard"] == pytest.approx((2 / 4 + 1) / 2)
    assert s["lost"] == 1 and s["rows_identical"] == 1
    e = M.expert_agreement(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 4]]))
    assert e["expert_set_same"] == 0.5 and e["expert_overlap"] == 0.75


def _game(a, b):
    """v(S) = Σ a_i·[i∈S] + b·[x∈S and y∈S]: additive plus one pairwise interaction."""
    return lambda s: sum(a[i] for i in s) + (b if {"x", "y"} <= s else 0.0)


def test_shapley_exact_closed_form():
    a = {"x": 1.0, "y": 2.0, "z": -0.5, "w": 0.25}
    phi = A.shapley_exact(list(a), _game(a, 3.0))
    assert phi["x"] == pytest.approx(1.0 + 1.5) and phi["y"] == pytest.approx(2.0 + 1.5)
    assert phi["z"] == pytest.approx(-0.5) and phi["w"] == pytest.approx(0.25)
    assert sum(phi.values()) == pytest.approx(sum(a.values()) + 3.0)     # efficiency


def test_shapley_sampled_converges():
    a = {"x": 1.0, "y": 2.0, "z": -0.5}
    phi = A.shapley_sampled(list(a), _game(a, 3.0), n_perm=400, seed=1)
    assert phi["z"] == pytest.approx(-0.5)
    assert phi["x"] == pytest.approx(2.5, abs=0.25) and phi["y"] == pytest.approx(3.5, abs=0.25)
    assert phi["x"] + phi["y"] == pytest.approx(6.0)


def test_attribute_with_bootstrap_ci():
    names = ["x", "y", "z"]
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, 50)
    a = {"x": 1.0, "y": 0.0, "z": 0.2}
    table = {}
    for r in range(4):
        import itertools
        for s in itertools.combinations(names, r):
            s = frozenset(s)
            table[s] = _game(a, 0.5)(s) + noise          # same per-prompt noise in every arm
    rows = A.attribute(names, table, n_boot=200, seed=0)
    by = {(r["method"], r["toggle"]): r for r in rows}
    assert by[("shapley", "x")]["value"] == pytest.approx(1.25)
    assert by[("one_at_a_time", "x")]["value"] == pytest.approx(1.0)
    assert by[("leave_one_out", "x")]["value"] == pytest.approx(1.5)
    r = by[("shapley", "y")]
    assert r["lo"] <= 0.25 <= r["hi"] and r["hi"] - r["lo"] < 1e-9      # paired: noise cancels


def test_one_factor_is_not_also_called_leave_one_out_or_a_shapley_share():
    """An endpoint arm against its baseline is one factor: its effect is one-at-a-time
    (leave-one-out, or a Shapley share, would be the same number under a name that suggests
    an engine minus t, or a share of several)."""
    rows = A.attribute(["x"], {frozenset(): np.zeros(4), frozenset({"x"}): np.arange(4.0)}, n_boot=50)
    assert {r["method"] for r in rows} == {"one_at_a_time"}
    assert all(r["value"] == pytest.approx(1.5) for r in rows)


def test_bootstrap_mean_ci():
    x = np.arange(100, dtype=float)
    m, lo, hi = A.bootstrap_mean_ci(x, n_boot=500)
    assert m == 49.5 and lo < 49.5 < hi and hi - lo < 20


def test_bootstrap_mean_ci_is_seeded_percentile_bootstrap():
    # by hand: resample indices from default_rng(seed), take the 2.5% / 97.5% quantiles
    x = np.random.default_rng(7).normal(size=37)
    for n_boot, seed, ci in [(1000, 0, 0.95), (301, 5, 0.9)]:
        idx = np.random.default_rng(seed).integers(0, len(x), (n_boot, len(x)))
        means = x[idx].mean(1)
        a = (1 - ci) / 2
        m, lo, hi = A.bootstrap_mean_ci(x, n_boot, seed, ci)
        assert m == pytest.approx(x.mean(), rel=1e-12)
        assert lo == pytest.approx(np.quantile(means, a), rel=1e-12)
        assert hi == pytest.approx(np.quantile(means, 1 - a), rel=1e-12)
    assert A.bootstrap_mean_ci([0.25]) == (0.25, 0.25, 0.25)
    assert A.bootstrap_mean_ci(iter([1.0, 1.0, 1.0])) == (1.0, 1.0, 1.0)


def test_span_metrics_equal_metrics_of_slices():
    g = torch.randn(20, 3, 5, dtype=torch.float64)
    a = g + 0.01 * torch.randn(20, 3, 5, dtype=torch.float64)
    spans = [(0, 20), (0, 7), (7, 20)]
    for (lo, hi), m in zip(spans, M.tensor_metrics_rows(g, a, spans)):
        ref = M.tensor_metrics(g[lo:hi], a[lo:hi])
        for k in ("rel_l2", "cosine", "sqnr_db", "deepgemm_diff", "max_abs"):
            assert m[k] == pytest.approx(ref[k], rel=1e-12)
        assert m["max_abs_at"][0] == ref["max_abs_at"][0] + lo and m["max_abs_at"][1:] == ref["max_abs_at"][1:]
    gen = torch.Generator().manual_seed(0)

    def rows():        # distinct picks per row, some slots empty (-1), like the indexer's
        r = torch.stack([torch.randperm(12, generator=gen)[:6] for _ in range(12)])
        return torch.where(torch.rand(12, 6, generator=gen) < 0.2, -1, r)
    gi, ai = rows(), rows()
    for (lo, hi), m in zip([(0, 12), (3, 9)], M.set_metrics_rows(gi, ai, [(0, 12), (3, 9)])):
        rows = [(set(x for x in g if x >= 0), set(x for x in y if x >= 0))
                for g, y in zip(gi[lo:hi].tolist(), ai[lo:hi].tolist())]
        rows = [(G, A_) for G, A_ in rows if G or A_]
        assert m["rows"] == len(rows)
        assert m["lost"] == sum(len(G - A_) for G, A_ in rows)
        assert m["jaccard"] == pytest.approx(sum(len(G & A_) / len(G | A_) for G, A_ in rows) / len(rows))
