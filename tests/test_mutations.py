"""The mutation suite (tests/mutations/bugs.py, loaded as a plugin) on the trained tiny
model: the verdict names each one-line bug with the right first divergent layer, against
golden and, for engine + bug arms, against the engine arm; null arms name nothing.

A fast subset runs by default; `-m slow` runs all of it (`make test-slow`, also in CI)."""
import re
from pathlib import Path

import pandas as pd
import pytest

from fidelity.ab.design import ABSettings, FLOOR, FLOOR_ORDER, FLOOR_TIES
from fidelity.ab.run import ReportTarget, RunSite, run_ab
from fidelity.verdict import judge as J
from fidelity.verdict import signals as S
from fidelity.weights.source import load_tokenizer_for, load_weights
from kernel_toggles import toggle
from kernel_toggles.plugins import load_plugins
from reference_model.numerics import topk_highest_index_ties

BUGS = Path(__file__).parent / "mutations" / "bugs.py"
FAST = ["mut_rope_no_output_inverse", "mut_rope_decode_position_plus_one",
        "mut_rope_q_positions_wrap_256", "mut_index_first_64_entries", "mut_index_no_relu",
        "mut_moe_select_no_bias", "mut_attention_no_sink", "mut_lm_head_scaled"]
NULLS = ["null_identity_rope", "null_identity_routing", "null_tie_order"]
# changes inside the model with the outcome within floors: named as mechanism findings
MECHANISM = ["mut_index_drop_last_pick", "mut_index_hides_newest_entry", "index_keys_fp8"]


def _register_nulls():
    """Null arms: kernels that return golden's own result, and the tie-order floor written
    as a toggle. None of them may be named."""
    from kernel_toggles import names
    if "null_tie_order" in names():
        return

    @toggle("null_identity_rope", kernel="rope_apply", category="known-bug",
            description="Null: golden RoPE through a user toggle.")
    def _(g, *a, **k):
        return g.rope_apply(*a, **k)

    @toggle("null_identity_routing", kernel="moe_select", category="known-bug",
            description="Null: golden expert selection through a user toggle.")
    def _(g, *a, **k):
        return g.moe_select(*a, **k)

    @toggle("null_tie_order", kernel="index_topk", category="known-bug",
            description="Null: the tie-order floor (ties to the higher index) as a toggle.")
    def _(g, scores, k):
        return topk_highest_index_ties(scores, k)


@pytest.fixture(scope="module")
def bugs():
    load_plugins([str(BUGS)])
    _register_nulls()
    import sys
    mod = next(m for n, m in sys.modules.items() if n.startswith("_dsv4_fidelity_plugin_bugs"))
    return mod.EXPECTED


@pytest.fixture(scope="module")
def model():
    w, _ = load_weights(None)
    return w, load_tokenizer_for(None)


def _run(model, arms, **kw):
    w, tok = model
    s = ABSettings.of(arms=arms, lengths=(250, 511), prompts_per_length=2, decode_steps=2,
                      shapley_top=0, n_boot=500, **kw)
    return run_ab(w, s, ReportTarget(None), RunSite(), tokenizer=tok)


def _score(res, expected, names, vs="golden"):
    """Per mutation: named by the verdict, and first divergence (vs `vs`) at the expected
    layer and phase."""
    named = _found(res)
    fd = {f["arm"]: f for f in res["first_divergence"] if f["vs"] == vs}
    rows = []
    for arm, bug in names:
        layer, phase, _ = expected[bug]
        f = fd.get(arm)
        rows.append({"bug": bug, "named": bug in named, "fd_layer": f and f["layer"],
                     "fd_phase": f and f["phase"],
                     "ok": bug in named and f is not None and (f["layer"], f["phase"]) == (layer, phase)})
    return pd.DataFrame(rows)


def _found(res) -> set[str]:
    """Toggles the verdict names, by outcome or by mechanism."""
    v = res["verdict"]
    return {n["toggle"] for n in v["named"]} | {f["toggle"] for f in v["mechanism"]}


def _assert_nulls_unnamed(res):
    named = _found(res)
    assert not named & set(NULLS), (named, res["verdict"]["sentence"])


def test_fast_mutations_named_at_their_layer(bugs, model):
    res = _run(model, FAST + MECHANISM + NULLS)
    t = _score(res, bugs, [(b, b) for b in FAST + MECHANISM[:2]])
    assert t.ok.all(), t.to_string()
    _assert_nulls_unnamed(res)
    # the indexer bugs and the seeds' root cause: mechanism findings first seen at layer 1
    # (the first CSA layer), judged against the tie-order / reduction-order floors
    mech = {f["toggle"]: f for f in res["verdict"]["mechanism"]}
    for name in MECHANISM:
        s = mech[name]["signals"][0]
        layers = [int(m.group(1)) for p in s["places"] if (m := re.fullmatch(r"layer (\d+)", p))]
        # first seen at layer 1; which CSA layer is strongest is not the claim (it varies
        # with the machine's float reductions: layer 3 on CI's CPU, layer 1 here)
        assert s["signal"] == "topk_loss" and min(layers) == 1, (name, s)
        assert s["floor_arm"] in (FLOOR_ORDER, FLOOR_TIES)
    assert not mech["index_keys_fp8"]["outcome_named"]


def test_floors_as_arms_are_not_named(bugs, model):
    """Each floor's own signals, attributed as if it were a toggle arm, clear no floor."""
    res = _run(model, ["null_identity_rope"])
    sig = res["signals"]
    floors = S.floor_levels(res["signal_summary"], [FLOOR, FLOOR_ORDER, FLOOR_TIES])
    for fl in (FLOOR, FLOOR_ORDER, FLOOR_TIES):
        sets = {fl: frozenset({"as_arm"})}
        attr = S.attribute_signals(sig, S.Design("golden", sets, ["as_arm"], []), S.Bootstrap(500, 0))
        verdict, _ = J.verdict(attr, floors)
        assert verdict["culprit"] is None, (fl, verdict["sentence"])


@pytest.mark.slow
def test_all_mutations_named_at_their_layer(bugs, model):
    names = list(bugs)
    assert len(names) >= 20
    res = _run(model, names + NULLS)
    t = _score(res, bugs, [(b, b) for b in names])
    print(t.to_string())
    assert t.ok.mean() >= 0.9, t[~t.ok].to_string()
    _assert_nulls_unnamed(res)


@pytest.mark.slow
def test_engine_plus_mutation_named_against_engine(bugs, model):
    """engine + bug arms: named through their effect added to the engine arm, first
    divergence measured directly against the engine arm (bit-identical until the bug acts)."""
    from kernel_toggles import ToggleError, ToggleSet
    names = []
    for b in bugs:                 # bugs that replace an engine kernel without wrapping it are refused
        try:
            ToggleSet.parse(f"engine,{b}")
            names.append(b)
        except ToggleError as e:
            assert "does not wrap it" in str(e)
    assert len(names) >= 20
    res = _run(model, ["engine"] + [f"engine,{b}" for b in names], vs="engine")
    t = _score(res, bugs, [(f"engine,{b}", b) for b in names], vs="engine")
    print(t.to_string())
    assert t.ok.mean() >= 0.9, t[~t.ok].to_string()
