"""The per-prompt tail (fidelity.verdict.tail): a toggle that breaks 2 of 18 prompts far
beyond their floors is named with its prompts; arms inside the floors never are."""
import math

import numpy as np
import pytest
import pandas as pd

from fidelity.verdict.judge import Bootstrap, Design, judge
from fidelity.verdict.tail import BROKEN, p_value, tail_tests

FLOORS = ["floor:a", "floor:b", "floor:c"]


def _binom_sf(k, n, q):
    """P(Bin(n, q) >= k) by the sum, independently of scipy."""
    return sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(k, n + 1))


def test_p_value_is_the_markov_binomial_bound_by_hand():
    ratios = np.array([2300.0, 550.0] + [0.5] * 16)
    want = 2 * min(_binom_sf(1, 18, 1 / 2300), _binom_sf(2, 18, 1 / 550))
    assert math.isclose(p_value(ratios, 18), want, rel_tol=1e-9)
    assert want < 0.002


def test_no_broken_prompt_gives_one_and_a_lone_modest_prompt_is_not_enough():
    assert p_value(np.array([9.9, 1.0, 0.2]), 3) == 1.0
    # one prompt at 20x of 18: 1 - (1 - 1/20)^18 = 0.60, not named
    assert math.isclose(p_value(np.array([20.0] + [1.0] * 17), 18), 1 - (1 - 1 / 20) ** 18)


def _signals(arm_values: dict[str, np.ndarray], seed=0, signal="answer_kld") -> pd.DataFrame:
    """Floors drawn lognormal around 1e-3 per prompt (a prompt-dependent scale), arms given."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(arm_values.values())))
    scale = 1e-3 * np.exp(rng.normal(0, 0.5, n))
    rows = []
    for f in FLOORS:
        vals = scale * np.exp(rng.normal(0, 0.3, n))
        rows += [{"arm": f, "prompt": f"p{i:02d}", "signal": signal, "where": "final logits",
                  "value": float(v)} for i, v in enumerate(vals)]
    for arm, vals in arm_values.items():
        vals = np.where(np.isnan(vals), scale * np.exp(rng.normal(0, 0.3, n)), vals)
        rows += [{"arm": arm, "prompt": f"p{i:02d}", "signal": signal, "where": "final logits",
                  "value": float(v)} for i, v in enumerate(vals)]
    rows += [{"arm": "golden", "prompt": f"p{i:02d}", "signal": signal, "where": "final logits",
              "value": 0.0} for i in range(n)]
    return pd.DataFrame(rows)


def _two_bad(n=18):
    v = np.full(n, np.nan)
    v[5], v[11] = 3.68, 0.88
    return v


def test_a_toggle_that_breaks_two_of_eighteen_prompts_is_named_with_them():
    sig = _signals({"bug": _two_bad(), "null": np.full(18, np.nan)})
    describe = {f"p{i:02d}": f"{250 + i} tokens, needle at 70%" for i in range(18)}
    d = Design("golden", {"bug": frozenset({"bug"}), "null": frozenset({"null"})}, ["bug", "null"], FLOORS)
    res = judge(sig, d, Bootstrap(300, 0), describe=describe)
    v, t = res["verdict"], res["attribution"]
    mean_row = t[(t.toggle == "bug") & (t.method == "one_at_a_time")].iloc[0]
    assert not mean_row.clears                     # the bootstrap over prompts misses it
    assert v["culprit"] == "bug" and v["method"] == "tail"
    assert [n["toggle"] for n in v["named"]] == ["bug"]
    assert "breaks 2 of 18 prompts (worst: 255 tokens, needle at 70%)" in v["sentence"]
    assert "p05" in v["sentence"] and "p11" in v["sentence"]
    assert "answer_kld 3.68" in v["sentence"]


def test_null_arms_drawn_like_the_floors_are_never_named():
    named = 0
    for seed in range(30):
        sig = _signals({"null": np.full(18, np.nan)}, seed=seed)
        d = Design("golden", {"null": frozenset({"null"})}, ["null"], FLOORS)
        t = tail_tests(sig, d.arms, d.floors)
        named += int(((t.b > 0) & (t.p_value < 0.05)).sum())
    assert named == 0


def test_every_prompt_inside_the_floors_has_no_broken_prompt():
    sig = _signals({"inside": np.full(18, 1e-5)})
    t = tail_tests(sig, {"inside": frozenset({"inside"})}, FLOORS)
    assert int(t.b.iloc[0]) == 0 and t.p_value.iloc[0] == 1.0


def test_schedule_factors_are_context_and_multi_toggle_arms_are_left_to_attribution():
    sig = _signals({"bug@s": _two_bad(), "a+b": _two_bad()})
    arms = {"bug@s": frozenset({"bug", "@chunked(64)"}), "a+b": frozenset({"a", "b"})}
    t = tail_tests(sig, arms, FLOORS)
    assert list(t.toggle) == ["bug"] and t.schedule.iloc[0] == "chunked(64)"
    assert t.b.iloc[0] == 2 and t.lo.iloc[0] == 0.88 and t.value.iloc[0] == 3.68
    assert BROKEN * t.floor_hi.iloc[0] <= 0.88


@pytest.mark.slow           # fidelity ab's default 18 prompts: 37 s alone, minutes beside the suite
def test_ab_names_a_bug_that_breaks_two_of_its_eighteen_prompts(tmp_path):
    """tests/mutations/rare_bugs.py's page-table bug on `fidelity ab`'s default prompts:
    2 of 18 answers broken, the rest within their floors. Its mean effect's interval does
    not clear the floor; the tail names it with the prompts. (Golden under every schedule
    naming nothing: bench/bench_verdict_cases.py's nulls and tests/test_schedule.py.)"""
    from pathlib import Path

    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_tokenizer_for, load_weights
    from kernel_toggles.plugins import load_plugins
    load_plugins([str(Path(__file__).parent / "mutations" / "rare_bugs.py")])
    w, _ = load_weights(None)
    res = run_ab(w, ABSettings.of(arms=["rare_index_page_7"], shapley_top=0,
                                  n_boot=500), ReportTarget(tmp_path, "rare"), RunSite(),
                 tokenizer=load_tokenizer_for(None))
    v, t = res["verdict"], res["signal_attribution"]
    assert [n["toggle"] for n in v["named"]] == ["rare_index_page_7"]
    assert v["method"] == "tail"
    mean = t[(t.toggle == "rare_index_page_7") & (t.method == "one_at_a_time")
             & (t.signal == "answer_kld") & (t["where"] == "final logits")].iloc[0]
    assert not mean.clears
    tail = v["named"][0]["tail"]
    assert (tail["b"], tail["n"]) == (2, 18)
    assert "breaks 2 of 18 prompts" in v["sentence"]
    assert "L511-3" in tail["prompts"] and "L250-8" in tail["prompts"]
    assert "breaks 2 of 18 prompts" in (tmp_path / "rare" / "index.html").read_text()


def test_broken_prompts_too_few_to_name_are_said_not_hidden():
    """One prompt at ~30x its floor of 18 cannot be told from noise (p ~ 0.45), so no toggle
    is named -- and the sentence says that prompt broke instead of "no toggle breaks a
    prompt" (the residue table counts it too)."""
    v = np.full(18, np.nan)
    v[3] = 0.05
    sig = _signals({"bug": v})
    d = Design("golden", {"bug": frozenset({"bug"})}, ["bug"], FLOORS)
    res = judge(sig, d, Bootstrap(300, 0))
    s = res["verdict"]["sentence"]
    assert res["verdict"]["named"] == [] and "no toggle breaks a prompt" not in s
    assert "Prompts broken (10x their floors) but too few to tell from noise: bug breaks 1 of 18" in s


def test_a_scheduled_arm_is_judged_against_the_serving_floors_not_qat():
    """t@chunked(64) breaks 3 of 18 prompts at ~1e-3: 100x the reduction-order floor, but
    under the QAT floor (1e-2, a property of the weights, the same on both sides of a chunk
    boundary), where t alone stays at the floors. The tail judges the scheduled arm against
    the serving floors and names it; the same values in a one-shot arm (v) stay judged
    against every floor, QAT included; and u, whose one-shot arm already has those values,
    breaks nothing *under* the schedule (the schedule does not make it worse)."""
    n = 18
    rows = []
    for i in range(n):
        p = f"p{i:02d}"
        hit = 1e-3 if i in (2, 7, 11) else 5e-6
        vals = {"floor:exact": 1e-2, "floor:fp32-accum": 1e-5, "floor:tie-order": 8e-6,
                "t@chunked(64)": hit, "t": 5e-6, "v": hit, "u@chunked(64)": hit, "u": hit}
        rows += [{"arm": a, "prompt": p, "signal": "answer_kld", "where": "final logits", "value": v}
                 for a, v in vals.items()]
    sig = pd.DataFrame(rows)
    arms = {"t@chunked(64)": frozenset({"t", "@chunked(64)"}), "t": frozenset({"t"}), "v": frozenset({"v"}),
            "u@chunked(64)": frozenset({"u", "@chunked(64)"}), "u": frozenset({"u"})}
    floors = ["floor:exact", "floor:fp32-accum", "floor:tie-order"]
    t = tail_tests(sig, arms, floors, serving=floors[1:]).set_index(["toggle", "schedule"])
    sched, oneshot = t.loc[("t", "chunked(64)")], t.loc[("v", "")]
    assert sched.b == 3 and sched.p_value < 0.05 and sched.floor_arm == "floor:fp32-accum"
    assert oneshot.b == 0 and oneshot.floor_arm == "floor:exact"
    assert t.loc[("u", "chunked(64)")].b == 0
