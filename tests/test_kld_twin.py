"""An engine judged against its twin (fidelity.kld.floors, fidelity.kld.twin).

In process, without any engine: a bug on top of llama.cpp's twin arithmetic is named
against the twin with finite floors that are noise on both sides (no QAT floor), an arm
equal to the twin is not. Over HTTP, against a real `fidelity serve` process: the clean arm
matches its twin (derived from what the server says it serves), the planted bug is the
unexplained finding the verdict leads with, and the golden judgement stays beside it."""
import json

import pandas as pd
import pytest
import torch

from fidelity.cli import main
from fidelity.kld.floors import floor_numerics
from fidelity.kld import twin as T

from needle_util import kld_exit, served

TWIN = "exact:expert_act_q8_0,router_softplus_logf,bf16_gemm_input,kv_cache_ggml"
SAME = "exact:kv_cache_ggml,expert_act_q8_0,router_softplus_logf,bf16_gemm_input"           # the twin spelled in another order
BUG = f"{TWIN},yarn_on_swa_layers"
GRID = ["--lengths", "250,511", "--depths", "10,50,90", "--decode-steps", "4", "--n-boot", "300"]


def test_floors_around_an_arm_are_noise_on_both_sides():
    names = [n for n, _ in floor_numerics(TWIN, "v4", torch.float64)]
    assert names == ["floor:fp32-accum", "floor:tie-order"]        # exact profile: no QAT floor
    (red, nx), (_, ties) = floor_numerics(TWIN, "v4", torch.float32)
    assert red == "floor:fp64-accum" and nx.cd == torch.float64 and nx.profile == "exact"
    assert nx.replaced and set(ties.replaced) == set(nx.replaced) | {"index_topk"}   # the twin's toggles on both
    ref = [n for n, _ in floor_numerics("kv_bf16", "v4", torch.float64)]
    assert ref == ["floor:exact", "floor:fp32-accum", "floor:tie-order"]          # an in-process baseline
    twin = [n for n, _ in floor_numerics("kv_bf16", "v4", torch.float64, qat=False)]
    assert twin == ["floor:fp32-accum", "floor:tie-order"]                          # an engine's twin


def test_inprocess_bug_named_against_the_twin_with_finite_floors(tmp_path):
    out = tmp_path / "out"
    rc = main(["kld", "--arm", f"twin={TWIN}", "--arm", f"bug={BUG}", "--arm", f"same={SAME}",
               "--baseline", "twin", *GRID, "--out", str(out), "--run-id", "r", "--quiet"])
    assert rc == 1                                                  # flagged: bug is named
    m = json.loads((out / "kld" / "r" / "manifest.json").read_text())
    v, floors = m["verdict"], pd.DataFrame(m["floors"])
    floors = floors[floors.signal != "nonfinite"]                   # judged against 0, whatever the floors
    assert set(floors.floor_arm) <= {"floor:fp32-accum", "floor:tie-order"}
    assert floors.floor_hi.notna().all() and (floors[floors.signal == "kld_mean"].floor_hi > 0).all()
    assert [n["toggle"] for n in v["named"]] == ["bug"]
    assert "nan" not in v["sentence"]
    s = pd.read_csv(out / "kld" / "r" / "signal_summary.csv")
    same = s[(s.arm == "same") & (s.signal == "kld_mean")]
    assert float(same["mean"].iloc[0]) == 0.0                       # bit-identical to the twin


def test_twin_options_are_checked():
    assert T.parse_options(["a=-ctk q8_0"], ["a"]) == {
        "a": "exact:kv_cache_ggml(type=q8_0),expert_act_q8_0,router_softplus_logf,bf16_gemm_input@decode_from(1)"}
    assert T.parse_options(["a=none"], ["a"]) == {"a": "none"}
    with pytest.raises(ValueError, match="no --endpoint is named 'b'"):
        T.parse_options(["b=golden"], ["a"])
    with pytest.raises(ValueError, match="expected NAME=ARM"):
        T.parse_options(["a"], ["a"])
    with pytest.raises(ValueError, match="-ctk q4_0"):
        T.parse_options(["a=-ctk q4_0"], ["a"])


class _Served:                          # what an endpoint says of itself, as fidelity serve says it
    def __init__(self, name, arm):
        self.name, self.model, self.dialect = name, name, "sglang"
        self.info = {"server_info": {"engine": "fidelity serve", "arms": {name: {"arm": arm, "profile": "reference"}}}}


def test_a_derived_twin_that_does_not_parse_here_is_a_note_a_given_one_an_error():
    def canonical(spelling):
        if "plugin_only" in spelling:
            raise ValueError("unknown toggle 'plugin_only'")
        return spelling
    twins, notes = T.twins_of([_Served("a", "kv_bf16"), _Served("b", "plugin_only")], {}, canonical)
    assert [(t.spelling, t.engines) for t in twins] == [("kv_bf16", ["a"])]
    assert len(notes) == 1 and notes[0].startswith("b: no twin") and "--twin b=ARM" in notes[0]
    with pytest.raises(ValueError, match="--twin b=plugin_only: unknown toggle"):
        T.twins_of([_Served("b", "x")], {"b": "plugin_only"}, canonical)


@pytest.fixture(scope="module")
def url():
    with served("golden", extra=("--arm", f"clean={TWIN}", "--arm", f"bug={BUG}")) as (u,):
        yield u


def test_served_engines_judged_against_golden_and_twin(tmp_path, url):
    out = tmp_path / "out"
    rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"clean={url}", "--endpoint", f"bug={url}",
               "--twin", f"bug={TWIN}", *GRID, "--no-captures", "--out", str(out), "--run-id", "r", "--quiet"])
    assert rc == 1                                      # flagged: bug is unexplained by its twin
    m = json.loads((out / "kld" / "r" / "manifest.json").read_text())
    v = m["verdict"]
    (tw,) = v["twins"]                          # the served clean arm's twin is the same arm as --twin's
    assert sorted(tw["engines"]) == ["bug", "clean"] and tw["twin"] == SAME
    assert tw["unexplained"] and [n["toggle"] for n in tw["named"]] == ["bug"]
    assert v["sentence"].startswith("Unexplained (vs its twin")
    assert "By design: the twin" in v["sentence"] and "Against golden:" in v["sentence"]
    # against the golden, by design, nothing is named beyond the QAT-sized floors: the bug hides there
    assert "bug" not in [n["toggle"] for n in v.get("named", [])]
    tv = json.loads((out / "kld" / tw["report"] / "manifest.json").read_text())
    assert [a["name"] for a in tv["manifest"]["arms"]] == ["twin", "clean", "bug", "twin~floor:fp32-accum",
                                                           "twin~floor:tie-order", "clean~repeat", "bug~repeat"]
    floors = pd.DataFrame(tv["floors"])
    floors = floors[floors.signal != "nonfinite"]
    assert set(floors.floor_arm) <= {"twin~floor:fp32-accum", "twin~floor:tie-order", "bug~repeat", "clean~repeat"}
    assert not floors.floor_arm.str.contains("floor:exact").any()
    s = pd.read_csv(out / "kld" / tw["report"] / "signal_summary.csv")
    km = s[s.signal == "kld_mean"].set_index("arm")["mean"]
    assert km["clean"] == 0.0 and km["clean~repeat"] == 0.0 and km["bug"] > 0
    page = (out / "kld" / "r" / "index.html").read_text()
    assert "Against the twin" in page and tw["report"] in page


def test_a_baseline_that_is_the_twin_is_judged_once(tmp_path, url):
    """--baseline twin when the endpoint's twin is that very arm: one judgement, no second
    arm under the same name."""
    out = tmp_path / "out"
    rc = main(["kld", "--arm", f"twin={SAME}", "--endpoint", f"clean={url}", "--baseline", "twin",
               "--lengths", "250", "--depths", "50", "--decode-steps", "2", "--no-floors", "--no-captures",
               "--out", str(out), "--run-id", "r", "--quiet"])
    assert rc == kld_exit(out / "kld" / "r")
    m = json.loads((out / "kld" / "r" / "manifest.json").read_text())
    assert "twins" not in m["verdict"] and [a["name"] for a in m["manifest"]["arms"]] == ["twin", "clean"]


def test_the_match_sentence_quotes_the_mean_not_a_tail_row():
    """A twin judgement that matches quotes the mean effect and its interval; a tail row (one
    prompt's value, zero-width interval) is not a mean (bench_llama_cpp once read 'largest mean
    KLD: 7.95e-05 [7.95e-05, 7.95e-05]' for a mean of 1.26e-05)."""
    import pandas as pd
    from fidelity.kld.twin import Twin, sentence
    att = pd.DataFrame([
        {"signal": "kld_mean", "toggle": "llama", "method": "tail", "value": 7.95e-05, "lo": 7.95e-05,
         "hi": 7.95e-05, "floor_hi": 1.87e-06, "floor_arm": "twin~floor:fp32-accum"},
        {"signal": "kld_mean", "toggle": "llama", "method": "one_at_a_time", "value": 1.26e-05, "lo": 4.84e-06,
         "hi": 2.39e-05, "floor_hi": 0.000123, "floor_arm": "twin~floor:fp32-accum"}])
    said = sentence(Twin("exact", "derived", ["llama"]), {"verdict": {}, "attribution": att})
    assert "llama, 1.26e-05 [4.84e-06, 2.39e-05]" in said and "7.95e-05" not in said


def test_a_change_inside_against_the_twin_leads_the_headline():
    """The seeds' class: an engine whose indexer picks move against its twin's while every
    outcome stays within the floors is said first ("Inside, against its twin"), not as a
    match (a lower-precision index-key build once read "matches the twin" with its picks
    moved on 11 of 209 rows)."""
    mech = [{"toggle": "keys", "outcome_named": False,
             "signals": [{"signal": "topk_loss", "places": ["layer 1", "layer 3"], "method": "one_at_a_time",
                          "where": "layer 1", "value": 0.04, "lo": 0.03, "hi": 0.05, "floor_hi": 0.0,
                          "floor_arm": "twin~floor:tie-order", "schedule": ""}]}]
    twin = {"name": "twin-keys", "twin": SAME, "unexplained": False, "mechanism": mech,
            "matches": "keys matches the twin", "named": []}
    h = T.headline({"twins": [twin]}, "golden words.")
    assert h.startswith("Inside, against its twin `twin-keys`: Nothing changes the outcome beyond its floors; "
                        "inside, keys changes indexer selection at layers 1 and 3")
    assert "top-k recall 0.960 vs floor 1.000" in h and h.endswith("Against the golden: golden words.")
    assert T.headline({"twins": [{**twin, "mechanism": []}]}, "g.").startswith("keys matches the twin.")
