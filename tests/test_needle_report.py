"""A two-arm HTTP sweep with known outcomes (one server always right, one always wrong)
through tables, McNemar and the report files."""
import json

import pytest

from infra.http import RetryPolicy
from needle.haystack import HaystackSpec
from needle.http import HttpRunner
from needle.report import write_report
from needle.stub import StubServer
from needle.sweep import SweepConfig, run_sweep
from reference_model.tokenizer import load_tokenizer


def test_two_arm_report(tmp_path):
    tok = load_tokenizer()
    with StubServer(tokenizer=tok, wrong_every=0) as good, StubServer(tokenizer=tok, wrong_every=1) as bad:
        runners = [HttpRunner("good", good.url, policy=RetryPolicy(retries=0)),
                   HttpRunner("bad", bad.url, policy=RetryPolicy(retries=0))]
        cfg = SweepConfig(lengths=[300, 400, 511], depths=[0, 50, 100], reps=2,
                          spec=HaystackSpec(kind="multikey"))
        rows = run_sweep(cfg, runners, tmp_path / "r.jsonl", quiet=True)
    assert len(rows) == 36
    assert {r["outcome"] for r in rows if r["arm"] == "good"} == {"correct"}
    assert {r["outcome"] for r in rows if r["arm"] == "bad"} == {"wrong"}
    assert all(r["token_residual"] == 0 and r["exact_length"] for r in rows)
    out = write_report(rows, tmp_path / "rep", {"what": "test"})
    t = json.loads((out / "summary.json").read_text())["tables"]
    (allp,) = [p for p in t["pairs"] if p["scope"] == "all"]
    # 18 discordant pairs all one way: exact two-sided p = 2 / 2^18
    assert (allp["n_pairs"], allp["a_only"], allp["b_only"], allp["test"]) == (18, 18, 0, "exact")
    assert allp["p_value"] == 2 / 2 ** 18 and allp["delta"] == 1.0 and allp["significant"]
    cellp = [p for p in t["pairs"] if p["scope"] == "cell"]
    assert len(cellp) == 9 and all(p["p_value"] == 0.5 for p in cellp)   # 2 pairs per cell
    good = [c for c in t["cells"] if c["arm"] == "good"]
    assert all(c["recall"] == 1.0 and abs(c["ci_low"] - 0.3424) < 1e-3 for c in good)  # Wilson 2/2
    names = {p.name for p in out.iterdir()}
    assert {"heatmap_good.png", "heatmap_bad.png", "delta_good_vs_bad.png", "recall_vs_length.png",
            "outcomes.png", "index.html", "summary.md", "cells.csv", "pairs.csv"} <= names
    for n in names:
        if n.endswith(".png"):
            assert (out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "index.html").read_text()
    assert html.count("data:image/png;base64,") == sum(n.endswith(".png") for n in names)
    assert "| good | bad | all |" in (out / "summary.md").read_text()


def test_mechanism_line_pools_trials_and_layers():
    from needle.report import _mechanism_lines
    rows = [{"arm_a": "golden", "arm_b": "bug", "layer": 1, "n": 20, "a_only": 3, "b_only": 0,
             "identical_picks": 12, "p_value": 0.25},
            {"arm_a": "golden", "arm_b": "bug", "layer": 3, "n": 20, "a_only": 3, "b_only": 0,
             "identical_picks": 10, "p_value": 0.25},
            {"arm_a": "golden", "arm_b": "bug", "layer": "all", "n": 40, "a_only": 6, "b_only": 0,
             "identical_picks": 22, "p_value": 0.03125},
            {"arm_a": "golden", "arm_b": "null", "layer": "all", "n": 40, "a_only": 0, "b_only": 0,
             "identical_picks": 40, "p_value": 1.0}]
    assert _mechanism_lines({"mechanism_pairs": rows}, "golden") == [
        "Mechanism: `bug` loses the needle's indexer entry in 6 of 40 trial × CSA layer pairs where "
        "`golden` keeps it (0 the other way, McNemar p = 0.031); picks identical in 22 of 40."]


def test_fragility_from_paired_margins():
    """A's margins 0.1, 0.3, 2.0; B shifts them by 0.2, 0.2, 0.4 (median 0.2): the first
    two sit within twice that (0.4) of the boundary."""
    from needle.tables import mechanism_pairs
    rows = []
    for tid, (ma, mb) in enumerate([(0.1, 0.3), (0.3, 0.1), (2.0, 1.6)]):
        for arm, m in (("golden", ma), ("engine", mb)):
            rows.append({"arm": arm, "trial_id": str(tid), "outcome": "correct",
                         "mechanism": [{"layer": 1, "in_topk": True, "in_window": False, "picks": [1, 2],
                                        "margin": m, "best_rank": 1, "topk": 2}]})
    (p,) = mechanism_pairs(rows)
    assert p["margin_shift_median"] == pytest.approx(0.2) and p["fragile_rate"] == pytest.approx(2 / 3)


def test_delta_heatmap_text_is_readable_on_dark_cells_and_zero_is_plain():
    """A -1 cell is dark blue: its label is white; an exact 0 reads "0", not "+0.00"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from needle.report import DELTA_SCALE, RECALL_SCALE, _heatmap
    fig = _heatmap(plt, ([383, 642], [0, 100]), [[0.0, 0.0], [0.0, -1.0]], "delta", DELTA_SCALE)
    texts = {t.get_text(): t.get_color() for t in fig.axes[0].texts}
    assert texts == {"0": "black", "-1.00": "white"}
    fig = _heatmap(plt, ([383], [0, 100]), [[1.0], [0.5]], "recall", RECALL_SCALE)
    assert {t.get_text() for t in fig.axes[0].texts} == {"1.00", "0.50"}
    plt.close("all")


def test_recall_lost_is_what_the_needle_command_flags():
    """`fidelity needle` exits 1 for an arm that loses recall against the first arm by the
    paired test, 0 for one that differs by chance or gains (needle.tables.recall_lost)."""
    from needle.tables import recall_lost

    def rows(arm, wrong):
        return [{"arm": arm, "trial_id": f"t{i}", "length": 512, "depth": 50,
                 "outcome": "wrong" if i in wrong else "correct"} for i in range(12)]
    base = rows("golden", {0})
    lost, chance, better = rows("lost", set(range(10))), rows("chance", {1, 2}), rows("better", set())
    # lost: 9 discordant pairs all one way (exact p = 2 * 0.5^9 = 0.004); chance: 2 vs 1 (p = 1)
    assert recall_lost(base + lost + chance + better) == ["lost"]
    assert recall_lost(base + chance) == [] and recall_lost(base) == []
