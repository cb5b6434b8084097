"""Schedules (reference_model.schedule): the golden is an exact oracle for how a prompt is
served -- chunked prefill, a prefix-cache hit (state saved and restored), the tail through
the decode path -- bit-identical to one-shot at every boundary class; the planted serving
bugs act only under the schedule that has their boundary; bad schedules are clear errors."""
import pytest
import torch

from kernel_toggles import ToggleSet
from reference_model import Model, Numerics
from reference_model.config import tiny
from reference_model.schedule import Schedule, ScheduleError, Segment
from reference_model.weights import random_weights

N = 300


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), 1)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(6, 500, (N,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def oneshot(weights, tokens):
    return Model(weights, Numerics("reference")).prefill_logits(tokens)


def _boundaries():
    """Window 32, CSA ratio 4, HCA ratio 128 and a 64-token page, each -1, 0, +1."""
    return sorted({b + d for b in (32, 4 * 16 + 2, 128, 64, 256) for d in (-1, 0, 1)})


@pytest.mark.parametrize("kind", ["chunked", "prefix_hit"])
def test_golden_is_exact_under_every_schedule_boundary(weights, tokens, oneshot, kind):
    for b in _boundaries():
        out = Model(weights, Numerics("reference"), schedule=Schedule(kind, b)).prefill_logits(tokens)
        assert torch.equal(out, oneshot), (kind, b)


def test_golden_is_exact_through_the_decode_path(weights, tokens, oneshot):
    for p in (N - 45, 256, 257):                    # across the HCA boundary at 256
        out = Model(weights, Numerics("reference"), schedule=Schedule("decode_from", p)).prefill_logits(tokens)
        assert torch.equal(out, oneshot), p


def test_indexer_picks_line_up_under_every_schedule(weights, tokens):
    """Every schedule taps one indexer row per position, also for chunks or decode steps
    before the first compressed entry exists (kld compares the rows by position)."""
    from reference_model.taps import Taps
    name = "layers.1.attn.index.topk"
    ref = Taps([name])
    Model(weights, Numerics("reference")).prefill_logits(tokens, ref)
    for s in ("decode_from(1)", "chunked(2)", "prefix_hit(3)"):
        taps = Taps([name])
        Model(weights, Numerics("reference"), schedule=Schedule.parse(s)).prefill_logits(tokens, taps)
        assert torch.equal(taps[name], ref[name]), s


def test_segments():
    assert Schedule.parse("chunked(4)").segments(10) == [Segment(0, 4), Segment(4, 8), Segment(8, 10)]
    assert Schedule.parse("prefix_hit(6)").segments(10) == [Segment(0, 6), Segment(6, 10, restore=True)]
    assert Schedule.parse(" decode_from( 8 ) ").segments(10) == [
        Segment(0, 8), Segment(8, 9, "decode"), Segment(9, 10, "decode")]
    assert str(Schedule.parse("prefix_hit(128)")) == "prefix_hit(128)" and str(Schedule()) == "oneshot"


@pytest.mark.parametrize("text,msg", [("chunked(0)", "at least 1"), ("prefix_hit", "needs a token count"),
                                      ("page(3)", "unknown schedule"), ("oneshot(2)", "no argument"),
                                      ("chunked(-4)", "at least 1"), ("", "unknown schedule")])
def test_bad_schedules_are_clear_errors(text, msg):
    with pytest.raises(ScheduleError, match=msg.replace("(", r"\(")):
        Schedule.parse(text)


def test_prefix_must_be_shorter_than_the_prompt():
    with pytest.raises(ScheduleError, match=r"prefix \(300 tokens\) must be shorter than the prompt \(300"):
        Schedule.parse("prefix_hit(300)").segments(300)


def test_which_lengths_a_schedule_cannot_apply_to():
    assert Schedule.parse("prefix_hit(300)").cannot_apply([250, 300, 511])[0] == [250, 300]
    assert Schedule.parse("decode_from(100)").cannot_apply([250, 511]) == ([], "")
    assert Schedule.parse("chunked(512)").cannot_apply([511, 250])[0] == [250, 511]   # never a boundary
    assert Schedule.parse("chunked(300)").cannot_apply([250, 511]) == ([], "")        # one at 511
    assert Schedule.parse("batch(8)").cannot_apply([4]) == Schedule().cannot_apply([4]) == ([], "")


@pytest.mark.parametrize("bug,schedule", [("restore_drops_compressor_pending", "prefix_hit(130)"),
                                          ("restore_window_one_off", "prefix_hit(130)"),
                                          ("restore_saved_one_token_later", "prefix_hit(130)"),
                                          ("chunk_stale_index_keys", "chunked(64)")])
def test_serving_bugs_act_only_at_their_boundary(weights, tokens, oneshot, bug, schedule):
    nx = ToggleSet.parse(bug).numerics("reference")
    for s in ("oneshot", "prefix_hit(130)", "chunked(64)"):
        out = Model(weights, nx, schedule=Schedule.parse(s)).prefill_logits(tokens)
        assert torch.equal(out, oneshot) == (s != schedule), (bug, s)
    # the bug's rows differ only from the boundary on
    out = Model(weights, nx, schedule=Schedule.parse(schedule)).prefill_logits(tokens)
    first = int((out != oneshot).any(-1).nonzero()[0])
    assert first >= Schedule.parse(schedule).n


def test_ab_names_serving_bugs_under_their_schedule_only(tmp_path):
    """`fidelity ab` with arms under schedules: golden under each schedule is a floor
    (exact here) and an arm (`golden@S`, the context a bug under S is measured against).
    Each planted serving bug is named under the schedule that exposes it, its effect over
    golden@S judged against the serving floors (not the QAT one): the stale-keys bug under
    chunked(64) and the pending-rows restore under prefix_hit(130) both first diverge at the
    first CSA layer's picks and change indexer selection; the window ring restored one row
    off first diverges at layer 0's attention. One-shot, the same bug names nothing; the
    report says where each arm under its schedule departs."""
    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_tokenizer_for, load_weights
    w, _ = load_weights(None)
    arms = ["chunk_stale_index_keys@chunked(64)", "restore_drops_compressor_pending@prefix_hit(130)",
            "restore_window_one_off@prefix_hit(130)", "restore_saved_one_token_later@prefix_hit(130)",
            "restore_drops_compressor_pending", "restore_window_one_off"]
    res = run_ab(w, ABSettings.of(arms=arms, lengths=(200,), prompts_per_length=3, decode_steps=1,
                                  shapley_top=0, n_boot=300), ReportTarget(tmp_path, "sched"),
                 RunSite(), tokenizer=load_tokenizer_for(None))
    m, v = res["manifest"], res["verdict"]
    assert {"floor:schedule@chunked(64)", "floor:schedule@prefix_hit(130)"} <= set(m["floors"])
    s = res["summary"].set_index("arm")
    assert s.loc["floor:schedule@chunked(64)", "kld_mean"] == 0 == s.loc["golden@prefix_hit(130)", "kld_mean"]
    assert v["culprit"] == "chunk_stale_index_keys" and v["method"] == "under_schedule"
    named = {n["toggle"]: n for n in v["named"]}
    assert set(named) == {"chunk_stale_index_keys", "restore_drops_compressor_pending",
                          "restore_window_one_off", "restore_saved_one_token_later"}
    assert {t: (n["method"], n["schedule"]) for t, n in named.items()} == {
        "chunk_stale_index_keys": ("under_schedule", "chunked(64)"),
        "restore_drops_compressor_pending": ("under_schedule", "prefix_hit(130)"),
        "restore_window_one_off": ("under_schedule", "prefix_hit(130)"),
        "restore_saved_one_token_later": ("under_schedule", "prefix_hit(130)")}
    assert all(n["floor_arm"] != "floor:exact" for n in named.values())
    assert "breaks coherence under chunked(64)" in v["sentence"]
    mech = {f["toggle"]: f for f in v["mechanism"]}
    assert mech["restore_drops_compressor_pending"]["signals"][0]["schedule"] == "prefix_hit(130)"
    fd = {f["arm"]: (f["layer"], f["tap"]) for f in res["first_divergence"]}
    assert fd["chunk_stale_index_keys@chunked(64)"] == (1, "attn.index.topk")
    assert fd["restore_drops_compressor_pending@prefix_hit(130)"] == (1, "attn.index.topk")
    assert fd["restore_window_one_off@prefix_hit(130)"][0] == 0
    assert not {"restore_drops_compressor_pending", "restore_window_one_off", "golden@chunked(64)"} & set(fd)
    html = (tmp_path / "sched" / "index.html").read_text()
    assert ("Under prefix_hit(130): <code>restore_window_one_off@prefix_hit(130)</code> first departs "
            "from golden at layer 0") in html


def test_an_effect_equal_to_its_one_shot_effect_is_the_toggles_not_the_schedules(tmp_path):
    """A numerics bug acts the same with or without a cache hit: paired against its one-shot
    effect, its effect under prefix_hit(130) is not a schedule finding, so the verdict names
    it one-shot and never "under prefix_hit"; no schedule is a suspect; under decode_from
    the first-divergence phase says the tokens went through the decode path. The one-shot
    arm is not given: every toggle given only under a schedule gets it automatically."""
    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.verdict.board import suspects
    from fidelity.weights.source import load_tokenizer_for, load_weights
    w, _ = load_weights(None)
    arms = ["routed_scaling_double@prefix_hit(130)", "routed_scaling_double@decode_from(150)"]
    res = run_ab(w, ABSettings.of(arms=arms, lengths=(200,), prompts_per_length=3, decode_steps=1,
                                  shapley_top=0, n_boot=300), ReportTarget(tmp_path, "same"),
                 RunSite(), tokenizer=load_tokenizer_for(None))
    v, t = res["verdict"], res["signal_attribution"]
    assert "routed_scaling_double" in res["manifest"]["arms"]          # the one-shot twin, added
    assert [n["toggle"] for n in v["named"]] == ["routed_scaling_double"]
    assert v["method"] != "under_schedule" and " under " not in v["outcome_sentence"]
    sched = t[t.method == "under_schedule"]
    assert len(sched) and sched.same_as_oneshot.all() and not sched.clears.any()
    assert not t.toggle.str.startswith("@").any()
    assert not suspects(t).toggle.str.startswith("@").any()
    fd = {f["arm"]: f["phase"] for f in res["first_divergence"]}
    assert fd["routed_scaling_double@decode_from(150)"] == "prefill to token 150, decode path after"
    assert fd["routed_scaling_double"] == "prefill"


def test_arm_strings_carry_a_schedule_and_serve_refuses_one(capsys):
    from fidelity.design.arms import ArmError, parse_arm
    from fidelity.cli import main
    a = parse_arm("engine@prefix_hit(64)")
    assert a.name.endswith("@prefix_hit(64)") and a.schedule == Schedule("prefix_hit", 64)
    assert parse_arm("golden").schedule == Schedule()
    with pytest.raises(ArmError, match="unknown schedule"):
        parse_arm("engine@warm(3)")
    assert main(["serve", "--arm", "x=engine@chunked(64)", "--port", "0"]) == 2
    assert "does not take a schedule" in capsys.readouterr().err


def test_inprocess_needle_and_kld_arms_take_a_schedule():
    """A serving bug reaches the in-process needle runner and kld's in-process scorer
    through the arm string: under its schedule the answer's logits move, one-shot not."""
    from fidelity.design.arms import parse_arm
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.weights.source import load_weights
    w, _ = load_weights(None)
    toks = torch.randint(6, 500, (200,), generator=torch.Generator().manual_seed(5))
    ref = Model(w, Numerics("reference")).prefill_logits(toks)
    for spec, moved in (("chunk_stale_index_keys@chunked(64)", True), ("chunk_stale_index_keys", False)):
        arm = parse_arm(spec)
        scorer = InProcessScorer(arm.name, arm.numerics(), w, schedule=arm.schedule)
        assert (not torch.equal(scorer.model.prefill_logits(toks), ref)) == moved, spec
    from fidelity.needle_run.runner import InProcessRunner
    from fidelity.weights.target import load_target
    runner = InProcessRunner("bug", load_target(None), "chunk_stale_index_keys@chunked(64)")
    assert runner.model.schedule == runner.model_rec.schedule == Schedule("chunked", 64)


def test_batch_dependent_kernel_sees_the_steps_token_count(weights, tokens):
    """mhc_splitk_by_batch splits the mHC GEMM only in small steps: a 40-token prefill alone
    (batch(1)) is split, the same prefill co-batched with 7 others (320 tokens) is not and
    equals golden exactly; the golden itself ignores the batch."""
    from reference_model import Taps
    toks = tokens[:40]
    nx = ToggleSet.parse("mhc_splitk_by_batch").numerics("reference")
    taps = {}
    for label, numerics, sched in (("golden", Numerics("reference"), "batch(8)"),
                                   ("alone", nx, "batch(1)"), ("cobatched", nx, "batch(8)")):
        taps[label] = Taps("layers.0.hc_attn.post")
        Model(weights, numerics, schedule=Schedule.parse(sched)).prefill_logits(toks, taps[label])
    g = taps["golden"]["layers.0.hc_attn.post"]
    assert torch.equal(taps["cobatched"]["layers.0.hc_attn.post"], g)
    assert not torch.equal(taps["alone"]["layers.0.hc_attn.post"], g)
    assert Schedule.parse("batch(8)").batch == 8 and Schedule.parse("chunked(8)").batch == 1


def test_decode_splitk_by_batch_depends_on_the_steps_tokens(weights, tokens):
    """decode_splitk_by_batch splits a decode step alone in max_splits // (step tokens)
    bf16 partials: decoded alone the logprobs move, decoded beside 7 others (batch(8): one
    pass) they equal golden's; the prefill is untouched either way."""
    from reference_model.generate import Decoder, Scoring
    ids = tokens[:120].tolist()
    nx = ToggleSet.parse("decode_splitk_by_batch").numerics("reference")

    def lps(numerics, sched):
        d = Decoder(Model(weights, numerics, schedule=Schedule.parse(sched)), ids, 5, scoring=Scoring(top=1))
        return [s.logprob for s in d.run().scores]
    golden, alone, cobatched = lps(Numerics("reference"), "oneshot"), lps(nx, "oneshot"), lps(nx, "batch(8)")
    assert cobatched == golden
    assert alone[0] == golden[0] and alone[1:] != golden[1:]      # first token: from the prefill


def test_decode_positions_wrap_acts_only_past_its_buffer(weights, tokens):
    """decode_positions_wrap(at=130): a 120-token prompt decoded 20 tokens is exact until the
    generation reaches position 130, then its logprobs leave golden's; the prefill is exact."""
    from reference_model.generate import Decoder, Scoring
    ids = tokens[:120].tolist()

    def lps(arm):
        nx = ToggleSet.parse(arm).numerics("reference") if arm else Numerics("reference")
        return [s.logprob for s in Decoder(Model(weights, nx), ids, 20, scoring=Scoring(top=1)).run().scores]
    golden, bug = lps(""), lps("decode_positions_wrap(at=130)")
    assert bug[:10] == golden[:10] and bug[11:] != golden[11:]   # step t is computed at position 119 + t
