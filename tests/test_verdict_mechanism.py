"""Mechanism vs outcome in the verdict: mechanism signals judged against the floors that
are noise for them, binary signals tested exactly over pooled trials (hand-computed
p-values), findings reported apart from the outcome."""
import pandas as pd
import pytest

from fidelity.verdict import binary as B
from fidelity.verdict.findings import mechanism_sentence
from fidelity.verdict.judge import Bootstrap, Design, judge
from fidelity.verdict.signals import floor_levels


def _lost(arm, losses, n_prompts=9, layers=(1, 3), suffix=""):
    """needle_lost rows: 1 for the first `losses` (prompt, layer) trials, else 0."""
    rows, i = [], 0
    for p in range(n_prompts):
        for layer in layers:
            rows.append({"arm": arm, "prompt": f"p{p}", "signal": "needle_lost",
                         "where": f"layer {layer}{suffix}", "value": float(i < losses)})
            i += 1
    return rows


def test_paired_exact_p_values_by_hand():
    x = pd.Series([1, 1, 1, 1, 1, 0, 0, 0], dtype=bool, index=list("abcdefgh"))
    y = pd.Series([0, 0, 0, 0, 0, 0, 0, 0], dtype=bool, index=list("abcdefgh"))
    assert B.paired(x, y) == (5, 0, 8, 1 / 32)                 # 0.5^5
    y2 = y.copy()
    y2["h"] = True                                             # 5 vs 1: P(X>=5 | 6) = 7/64
    b, c, n, p = B.paired(x, y2)
    assert (b, c, n) == (5, 1, 8) and p == pytest.approx(7 / 64)
    assert B.paired(y, y)[3] == 1.0                            # no discordant pair
    # only shared trials are paired
    assert B.paired(x, y.drop(["a", "b"]))[:3] == (3, 0, 6)


def test_one_loss_in_five_trials_is_named_at_36_trials():
    """The default ab design (18 prompts x 2 CSA layers = 36 trials): a bug that loses the
    needle's entry in 1 of 5 trials (7 of 36) where the floors lose none is named; the same
    losses bootstrapped per layer over 18 prompts would be judged against a 0 floor too,
    but 4 of 12 (three prompts per length) is not enough for the exact test."""
    sig = pd.DataFrame(_lost("bug", 7, 18) + _lost("floor:ties", 0, 18) + _lost("floor:order", 0, 18))
    t = B.exact_tests(sig, {"bug": frozenset({"bug"})}, ["floor:ties", "floor:order"])
    r = t.iloc[0]
    assert (r.b, r.c, r.n, r.method, r["where"]) == (7, 0, 36, "exact_vs_floors", B.POOLED)
    assert r.p_value == pytest.approx(0.5 ** 7) and bool(B.clears(t).iloc[0])
    small = pd.DataFrame(_lost("bug", 4, 6) + _lost("floor:ties", 0, 6))
    t = B.exact_tests(small, {"bug": frozenset({"bug"})}, ["floor:ties"])
    assert t.iloc[0].p_value == pytest.approx(1 / 16) and not B.clears(t).iloc[0]


def test_the_fewest_losses_a_run_names_and_the_power_said():
    """By hand: with no loss the other way 5 losses give p = 1/32 < 0.05 and 4 give 1/16;
    with one the other way, 7 give P(X >= 7 | 8) = 9/256 and 6 give P(X >= 6 | 7) = 8/128."""
    assert [B.detectable(c) for c in (0, 1)] == [5, 7]
    assert 9 / 256 < B.ALPHA <= 8 / 128
    small = pd.DataFrame(_lost("bug", 2, 6) + _lost("floor:ties", 0, 6))        # 2 of 12: a one-pick bug
    s = B.power_sentence(B.exact_tests(small, {"bug": frozenset({"bug"})}, ["floor:ties"]))
    assert s == ("Selection losses too few to name: `bug` lost the needle's entry in 2 of 12 (prompt, CSA layer) "
                 "trials where the floors kept it (0 the other way, exact p = 0.25): this run names 5 or more; "
                 "about 3x the prompts (--reps) would, if the rate holds.")
    clean = pd.DataFrame(_lost("bug", 0, 6) + _lost("floor:ties", 0, 6))
    assert B.power_sentence(B.exact_tests(clean, {"bug": frozenset({"bug"})}, ["floor:ties"])) == (
        "Selection power: a toggle is named for losing the needle's indexer entry when it loses it in 5 or "
        "more of the 12 (prompt, CSA layer) trials where the floors keep it.")
    named = pd.DataFrame(_lost("bug", 7, 18) + _lost("floor:ties", 0, 18))
    assert B.power_sentence(B.exact_tests(named, {"bug": frozenset({"bug"})}, ["floor:ties"])) == ""


def test_must_beat_every_floor_and_pairs_by_one_factor():
    sig = pd.DataFrame(_lost("bug", 6) + _lost("floor:a", 0) + _lost("floor:b", 6)
                       + _lost("engine", 2) + _lost("engine,bug", 8))
    arms = {"bug": frozenset({"bug"}), "engine": frozenset({"e"}),
            "engine,bug": frozenset({"e", "bug"})}
    t = B.exact_tests(sig, arms, ["floor:a", "floor:b"])
    vs_floors = t[(t.toggle == "bug") & (t.method == "exact_vs_floors")].iloc[0]
    assert vs_floors.vs == "floor:b" and vs_floors.p_value == 1.0      # the worst floor
    added = t[t.method == "exact_vs_engine"].iloc[0]
    assert (added.toggle, added.b, added.c) == ("bug", 6, 0)           # engine,bug vs engine
    assert added.p_value == pytest.approx(1 / 64)


def test_length_groups_pooled_apart():
    sig = pd.DataFrame(_lost("bug", 5) + _lost("bug", 5, suffix=" @ L511")
                       + _lost("f", 0) + _lost("f", 0, suffix=" @ L511"))
    t = B.exact_tests(sig, {"bug": frozenset({"bug"})}, ["f"])
    assert sorted(t["where"]) == [B.POOLED, B.POOLED + " @ L511"] and (t.n == 18).all()


def _summary(rows):
    return pd.DataFrame(rows, columns=["arm", "signal", "where", "mean", "lo", "hi", "n"])


def test_mechanism_signals_ignore_the_qat_floor():
    s = _summary([("floor:exact", "topk_loss", "layer 1", 0.09, 0.08, 0.10, 9),
                  ("floor:ties", "topk_loss", "layer 1", 0.01, 0.01, 0.015, 9),
                  ("floor:exact", "kld_mean", "final logits", 1e-3, 9e-4, 1.2e-3, 9),
                  ("floor:ties", "kld_mean", "final logits", 1e-6, 1e-6, 2e-6, 9)])
    f = floor_levels(s, ["floor:exact", "floor:ties"], ["floor:ties"]).set_index("signal")
    assert f.loc["topk_loss", "floor_arm"] == "floor:ties" and f.loc["topk_loss", "floor_hi"] == 0.015
    assert f.loc["kld_mean", "floor_arm"] == "floor:exact"
    f_all = floor_levels(s, ["floor:exact", "floor:ties"]).set_index("signal")
    assert f_all.loc["topk_loss", "floor_arm"] == "floor:exact"


def _signals(arm, topk, kld, n=6):
    rows = []
    for p in range(n):
        jitter = 1 + 0.01 * p
        rows += [{"arm": arm, "prompt": f"p{p}", "signal": "topk_loss", "where": "layer 1",
                  "value": topk * jitter},
                 {"arm": arm, "prompt": f"p{p}", "signal": "kld_mean", "where": "final logits",
                  "value": kld * jitter}]
    return rows


def test_judge_reports_mechanism_apart_from_outcome():
    """A toggle that changes a tenth of the picks (recall 0.90 vs the tie floor's 0.985)
    with KLD under the QAT floor: no outcome finding, one mechanism finding in words."""
    sig = pd.DataFrame(_signals("t", 0.10, 5e-4) + _signals("floor:exact", 0.10, 1e-3)
                       + _signals("floor:ties", 0.015, 1e-6) + _signals("null", 0.0, 1e-7))
    d = Design("golden", {"t": frozenset({"t"}), "null": frozenset({"null"})}, ["t", "null"],
               ["floor:exact", "floor:ties"])             # mechanism: all floors but the QAT one
    v = judge(sig, d, Bootstrap(200, 0))["verdict"]
    assert v["culprit"] is None and v["named"] == []
    assert [f["toggle"] for f in v["mechanism"]] == ["t"]
    s = v["mechanism"][0]["signals"][0]
    assert s["signal"] == "topk_loss" and s["places"] == ["layer 1"]
    assert v["sentence"].startswith("No toggle changes the outcome beyond its floors")
    assert ("Mechanism: t changes indexer selection at layer 1 (top-k recall 0.897 vs floor 0.984); "
            "outcome within floors at these lengths.") in v["sentence"]
    # with every floor (the old rule), the QAT floor hides it
    v_old = judge(sig, Design("golden", d.arms, d.factors, d.floors, mechanism_floors=d.floors),
                  Bootstrap(200, 0))["verdict"]
    assert v_old["mechanism"] == [] and "No toggle stands out" in v_old["sentence"]


def test_sentence_for_an_exact_finding_and_several_layers():
    f = [{"toggle": "bug", "outcome_named": True, "signals": [
        {"signal": "topk_loss", "places": ["layer 1", "layer 3", "layer 5"], "method": "leave_one_out",
         "value": 0.05, "lo": 0.03, "hi": 0.07, "floor_hi": 0.01},
        {"signal": "needle_lost", "places": [B.POOLED], "method": "exact_vs_floors", "b": 7, "c": 0,
         "n": 36, "p_value": 0.0078, "vs": "floor:ties", "floor_arm": "floor:ties",
         "value": 7 / 36, "lo": 0.1, "hi": 0.3, "floor_hi": 0.0}]}]
    s = mechanism_sentence(f)
    assert s.startswith("Mechanism: bug changes indexer selection at layers 1, 3 and 5 (topk_loss "
                        "leave-one-out effect 0.05")
    assert ("the needle's indexer entry at CSA layers pooled (lost in 7 of 36 trials where the "
            "floor (floor:ties) keeps it, 0 the other way, exact p = 0.0078)") in s
    assert "outcome within floors" not in s


def test_a_place_seen_only_on_the_longest_prompts_is_still_named():
    """A finding whose only place is a length group's (`layer 1 @ L511`) keeps that place:
    the sentence never reads "changes indexer selection at  (...)"."""
    from fidelity.verdict.findings import _places
    assert _places(pd.Series(["layer 1 @ L511"])) == ["layer 1 @ L511"]
    assert _places(pd.Series(["layer 1", "layer 1 @ L511", "layer 3 @ L511"])) == ["layer 1", "layer 3 @ L511"]
    f = [{"toggle": "bug", "outcome_named": False, "signals": [
        {"signal": "topk_loss", "places": _places(pd.Series(["layer 1 @ L511"])), "method": "one_at_a_time",
         "value": 0.05, "lo": 0.03, "hi": 0.07, "floor_hi": 0.01}]}]
    assert "changes indexer selection at layer 1 @ L511 (" in mechanism_sentence(f)


def test_check_gates_outcome_by_default_and_mechanism_on_request(tmp_path, capsys):
    """An arm that changes a tenth of the picks with KLD under the floors passes the default
    gate and fails `--mechanism`, judged against the tie-order and reduction-order floors
    (the QAT floor's own recall, 0.90, would have hidden it)."""
    from fidelity.cli import main
    cols = ["arm", "kld_mean", "kld_p99", "answer_kld", "topk_recall_min", "expert_same_min"]
    rows = [("floor:exact", 1e-3, 2e-2, 3e-4, 0.90, 0.95), ("floor:fp32-accum", 1e-6, 1e-5, 1e-6, 0.99, 0.99),
            ("floor:tie-order", 1e-6, 1e-5, 1e-6, 0.985, 1.0), ("t", 7e-4, 1e-2, 2e-4, 0.902, 0.99)]
    pd.DataFrame(rows, columns=cols).to_csv(tmp_path / "summary.csv", index=False)
    assert main(["check", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path), "--mechanism"]) == 1
    out = capsys.readouterr().out
    assert "t: topk_recall_min = 0.902 < 0.935 (worst floor - 0.05)" in out


def test_entry_margin_by_hand():
    import math
    import torch
    from fidelity.ab.margins import entry_margin, margin_fields
    inf = float("inf")
    s = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, -inf])
    # top-2 = {0, 2}; needle entries {2, 3}: best is 2 (4.0), rank 2, margin 4 - 3 = 1
    assert entry_margin(s, [2, 3], 2) == {"score": 4.0, "rank": 2, "margin": 1.0, "n_visible": 5}
    # needle at entry 4 (2.0), rank 4, outside: margin 2 - 4 (the lowest kept) = -2
    assert entry_margin(s, [4], 2)["margin"] == -2.0
    assert math.isnan(entry_margin(s, [5], 2)["score"])               # not visible
    assert math.isnan(entry_margin(s, [0], 5)["margin"])              # every entry kept
    arm = s + torch.tensor([0.0, 0.1, -0.3, 0.2, 0.0, 0.0])
    f = margin_fields(s, arm, [2], 2)
    assert f["dscore_max"] == pytest.approx(0.3) and f["fragile"] is False    # 1.0 >= 0.6
    f = margin_fields(s, s + torch.tensor([0.0, 0.0, -0.6, 0.0, 0.0, 0.0]), [2], 2)
    assert f["fragile"] is True and f["margin"] == pytest.approx(0.4)         # 3.4 - 3


def test_mechanism_floors_default_to_all_but_the_qat_floor():
    d = Design("golden", {}, [], ["floor:exact", "floor:tie-order", "floor:fp32-accum"])
    assert d.noise_for_mechanism() == ["floor:tie-order", "floor:fp32-accum"]
    assert Design("g", {}, [], ["g~repeat"]).noise_for_mechanism() == ["g~repeat"]
    assert Design("g", {}, [], ["floor:exact"]).noise_for_mechanism() == ["floor:exact"]


def test_score_shift_over_the_entries_both_hold():
    import torch
    from fidelity.ab.margins import score_shift
    g = torch.tensor([1.0, 2.0, 3.0, float("-inf")])
    assert score_shift(g, torch.tensor([1.5, 2.0, 2.0])) == {"dscore_p50": 0.5, "dscore_max": 1.0}


def test_departures_are_stated_for_one_toggle_arms_whose_outcome_is_not_named():
    """A first departure at 10x the floor is said in words for an arm of one toggle, the
    strongest first; an arm of several toggles (it departs where one of them does) and a
    toggle the outcome already names are left to the table."""
    from fidelity.verdict.findings import departure_sentence, with_departures

    def dep(arm, toggle, ratio, qat=None):
        return {"arm": arm, "toggle": toggle, "vs": "golden", "phase": "prefill", "layer": 0,
                "tap": "attn.kv", "ratio": ratio, "qat_ratio": qat}
    deps = [dep("a", "a", 58.0, 1.9), dep("b", "b", 362.0), dep("engine-x", None, 900.0), dep("c", "c", 12.0)]
    s = departure_sentence(deps, named={"c"})
    assert s.startswith("Departures (at least 10x the floor; outcome within floors): b first departs "
                        "from golden at layer 0 `attn.kv` (prefill) at 362x the reduction-order floor; "
                        "a first departs")
    assert "(1.9x the QAT floor)" in s and "engine-x" not in s and " c first" not in s
    v = with_departures({"sentence": "Nothing.", "named": [{"toggle": "c"}]}, deps)
    assert v["sentence"] == "Nothing. " + s and v["departures"] == deps
    assert departure_sentence([dep("engine-x", None, 900.0)], set()) == ""


def test_a_departure_below_the_bar_is_said_as_such_and_the_largest_is_found():
    """An arm steady at ~9x the floor never reaches first_divergence's 10x bar; its largest
    multiple is said ("Below the 10x bar"), never as a first departure in the headline."""
    from fidelity.ab.drift import largest_departure
    from fidelity.verdict.board import headline
    from fidelity.verdict.findings import departure_sentence
    rows = []
    for layer, (arm_v, floor_v) in enumerate([(2e-6, 1e-6), (9.1e-6, 1e-6), (4e-6, 1e-6)]):
        for arm, v in (("t", arm_v), ("floor:fp32-accum", floor_v)):
            rows.append({"arm": arm, "phase": "prefill", "bucket": "all", "layer": layer, "tap": "attn.out",
                         "rel_l2": v, "prompt": "p", "step": -1})
    near = largest_departure(pd.DataFrame(rows), "t", "floor:fp32-accum")
    assert (near["layer"], near["tap"]) == (1, "attn.out") and near["ratio"] == pytest.approx(9.1)
    d = {**near, "toggle": "t", "below_bar": True}
    s = departure_sentence([d], set())
    assert s == ("Below the 10x bar: t departs at most 9.1x the reduction-order floor "
                 "(layer 1 `attn.out`, prefill, mean over prompts).")
    assert "departs first" not in headline({"sentence": "", "departures": [d]})


def test_a_below_the_bar_departure_is_said_only_when_steady_across_prompts():
    """Six prompts at ~9x their floor: above it on 6/6, sign test p = 1/64, said with the
    per-prompt range. One prompt at 50x and five below their floors: the mean over prompts
    is ~9x too, but the departure is one prompt's, not steady: not said."""
    from fidelity.ab.drift import largest_departure, steadiness
    from fidelity.verdict.findings import near_enough, near_sentence

    def drift(values):
        return pd.DataFrame([{"arm": arm, "phase": "decode", "bucket": "all", "layer": 2, "tap": "attn.out",
                              "rel_l2": v, "prompt": f"p{i}", "step": s}
                             for i, x in enumerate(values) for s in (0, 1)
                             for arm, v in (("t", x * 1e-6), ("floor:fp32-accum", 1e-6))])
    steady = drift([8.6, 9.0, 9.3, 8.9, 9.1, 9.2])
    near = largest_departure(steady, "t", "floor:fp32-accum")
    st = steadiness(steady, "t", "floor:fp32-accum", "decode", 2, "attn.out")
    assert (st["n"], st["above"]) == (6, 6) and st["p"] == pytest.approx(1 / 64)
    assert (st["lo"], st["hi"]) == (pytest.approx(8.6), pytest.approx(9.3)) and near_enough(near["ratio"], st)
    said = near_sentence([{**near, "toggle": "t", "steady": st}])
    assert "above the floor on 6/6 prompts (per prompt 8.6-9.3x; sign test p = 0.016)" in said
    spike = drift([50, 0.5, 0.5, 0.5, 0.5, 0.5])
    near = largest_departure(spike, "t", "floor:fp32-accum")
    st = steadiness(spike, "t", "floor:fp32-accum", "decode", 2, "attn.out")
    assert near["ratio"] == pytest.approx(52.5 / 6) and st["above"] == 1 and not near_enough(near["ratio"], st)
    # two prompts can show no test: said only when both are above the floor
    assert near_enough(9.0, {"n": 2, "above": 2, "p": 0.25, "median": 9.0})
    assert not near_enough(9.0, {"n": 2, "above": 1, "p": 0.75, "median": 9.0})


def test_the_floor_to_beat_is_the_one_with_the_largest_p_whatever_its_name():
    """The worst floor is chosen by its p-value (it once was by the floor's name: the
    alphabetically last floor, right only when that was also the worst)."""
    sig = pd.DataFrame(_lost("bug", 6) + _lost("floor:a", 6) + _lost("floor:b", 0))
    t = B.exact_tests(sig, {"bug": frozenset({"bug"})}, ["floor:a", "floor:b"])
    r = t[t.method == "exact_vs_floors"].iloc[0]
    assert r.p_value == 1.0 and not bool(B.clears(t).iloc[0])


def test_the_board_says_which_rows_are_floors():
    """The QAT floor's row is labelled as the QAT floor (red there is QAT's own size, not a
    finding), other floors as floors, in italics above a rule; arms keep their names."""
    import matplotlib.pyplot as plt
    from fidelity.verdict.board import floor_label, signal_board
    assert floor_label("floor:exact") == "floor:exact (QAT floor)"
    assert floor_label("twin~floor:tie-order") == "twin~floor:tie-order (floor)" and floor_label("bug") == "bug"
    ss = pd.DataFrame([{"arm": a, "signal": "kld_mean", "where": "final logits", "mean": m}
                       for a, m in [("floor:exact", 1e-3), ("floor:fp32-accum", 1e-6), ("bug", 5e-2)]])
    fig = signal_board(ss, pd.DataFrame([{"signal": "kld_mean", "where": "final logits", "floor_hi": 1e-4}]),
                       ["floor:exact", "floor:fp32-accum", "bug"])
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["floor:exact (QAT floor)", "floor:fp32-accum (floor)", "bug"]
    assert [t.get_fontstyle() for t in ax.get_yticklabels()] == ["italic", "italic", "normal"]
    assert any(abs(line.get_ydata()[0] - 1.5) < 1e-9 for line in ax.get_lines())
    plt.close(fig)


def test_the_headline_departure_is_the_arm_the_finding_is_about():
    """A finding made under prefix_hit(130) quotes where t@prefix_hit(130) first departs,
    not where the one-shot arm of t does; a one-shot finding quotes the one-shot arm."""
    from fidelity.verdict.board import _first_place
    fd = [{"arm": "t", "vs": "golden", "layer": 3, "tap": "ffn.out", "phase": "prefill", "ratio": 12.0},
          {"arm": "t@prefix_hit(130)", "vs": "golden", "layer": 0, "tap": "attn.out", "phase": "prefill",
           "ratio": 900.0}]
    sets = {"t": frozenset({"t"}), "t@prefix_hit(130)": frozenset({"t", "@prefix_hit(130)"})}
    assert "layer 0 `attn.out`" in _first_place("t", fd, sets, "prefix_hit(130)")
    assert "layer 3 `ffn.out`" in _first_place("t", fd, sets, "")
    assert "layer 0 `attn.out`" in _first_place("t", fd[1:], sets, "")     # the only one there is


@pytest.mark.parametrize("method,words", [
    ("one_at_a_time", "changes the outcome: mean final-logit KLD is 0.0122"),
    ("added_to_base", "changes the outcome: added to the base arm, it raises mean final-logit KLD by 0.0122"),
    ("leave_one_out", "changes the outcome: taken out of the arm holding every toggle, it lowers mean final-logit KLD by 0.0122"),
    ("shapley", "changes the outcome: its Shapley share of mean final-logit KLD is 0.0122"),
])
def test_the_headline_names_an_effect_as_an_effect(method, words):
    """A value that is a difference one toggle makes to another arm is said as one, not as
    the toggle's own KLD; the multiple beside it is the same either way."""
    from fidelity.verdict.board import headline
    named = [{"toggle": "t", "method": method, "signal": "kld_mean", "where": "final logits", "value": 0.0122,
              "lo": 0.0082, "hi": 0.016, "floor_hi": 0.00125, "floor_arm": "floor:exact"}]
    said = headline({"named": named})
    assert said.startswith(f"t {words}, 9.76× the highest floor (0.00125, floor:exact), 6.56× at its 95%"), said


def test_a_small_departure_certain_on_every_prompt_is_named_as_such_and_a_null_never_is():
    """Sixteen prompts each 8.6-9.4x their floor: below the 10x bar but above it on 16/16
    (sign test p = 2^-16 = 1.5e-05 < 1e-4): a finding of its own class, in the verdict and the
    headline when nothing larger is found. Six prompts at the same multiples are only 'below
    the bar' (p = 1/64), and a null (bit-identical, 0x) or a re-association (~1x, half the
    prompts below their floor) reaches neither."""
    from fidelity.ab.drift import largest_departure, steadiness
    from fidelity.verdict.board import headline
    from fidelity.verdict.findings import certain, with_departures

    def dep(values):
        drift = pd.DataFrame([{"arm": arm, "phase": "prefill", "bucket": "all", "layer": 0, "tap": "attn.out",
                               "rel_l2": v, "prompt": f"p{i}", "step": -1}
                              for i, x in enumerate(values) for arm, v in (("t", x * 1e-6), ("floor:fp32-accum", 1e-6))])
        near = largest_departure(drift, "t", "floor:fp32-accum")
        st = steadiness(drift, "t", "floor:fp32-accum", "prefill", 0, "attn.out")
        return {**near, "toggle": "t", "below_bar": True, "steady": st} if near else None
    sure = dep([8.6 + 0.05 * i for i in range(16)])
    assert sure["steady"]["p"] == pytest.approx(2 ** -16) and certain(sure)
    v = with_departures({"sentence": "Nothing.", "named": []}, [sure])
    assert v["small_certain"] == [sure]
    assert "Small but certain: t departs 8.97x the reduction-order floor at layer 0 `attn.out` (prefill) on " \
           "16/16 prompts (per prompt 8.6-9.35x; sign test p = 1.5e-05)" in v["sentence"]
    assert "Below the 10x bar" not in v["sentence"]                  # said once, in its own class
    h = headline(v)
    assert h.startswith("No toggle changes the outcome beyond its floors; small but certain: t departs 8.97×")
    assert "16/16 prompts (sign test p = 1.5e-05)" in h
    few = dep([8.6, 9.0, 9.3, 8.9, 9.1, 9.2])
    assert not certain(few) and not with_departures({"sentence": "", "named": []}, [few])["small_certain"]
    reassociated = dep([0.5, 1.5] * 8)
    assert reassociated is None or not certain(reassociated)
    assert dep([0.0] * 16) is None or not certain(dep([0.0] * 16))   # a null: bit-identical
    named = with_departures({"sentence": "", "named": [{"toggle": "t"}]}, [sure])
    assert named["small_certain"] == []                              # already named by its outcome
