"""The long-generation family's one judgement, on generations built by the family's own
row code (LongGenFamily._rows / _behaviour) from KL series chosen here: the verdict and the
behaviour table say the same thing for flagged and unflagged runs; the floor is the
engine's re-read of the same tokens, so an onset at step 20 is dated at 20 and an arm that
differs from the reference as much re-read as generated is never flagged; misbehaviour
counts are judged by an exact test (2 of 2 against 1 of 2 is not a finding, 4 of 4 against
0 of 4 is). Served end to end in tests/test_consistency.py."""
import numpy as np
import pandas as pd
import pytest

from fidelity.consistency.client import Reply
from fidelity.consistency.judge import condition_table, longgen_lines, longgen_table, verdict_lines
from fidelity.consistency.longgen import Along, LongGenFamily, LongGenPlan, stretches
from fidelity.weights.target import load_target

TOK = load_target(None).tokenizer
N = 300
PLAN = LongGenPlan(probes=2, max_tokens=N, ignore_eos=True)


class _Arm:
    """All the family's row code reads of an arm: its name."""
    def __init__(self, name):
        self.name = name


def _plain(n: int, seed: int) -> list[int]:
    """n ordinary (non-special, non-looping) token ids."""
    special = set(TOK.special_ids.values())
    ok = [i for i in range(TOK.vocab_size)
          if i not in special and not any(c in TOK.decode([i], skip_special_tokens=False) for c in "<｜")]
    return [int(i) for i in np.random.default_rng(seed).choice(ok, n)]


def _tokens(n: int, seed: int, leak: bool) -> list[int]:
    """A generation of n tokens: thinking to the cap, or (leak) closing its thinking and then
    writing a <think> tag in the content."""
    if not leak:
        return _plain(n, seed)
    tail = TOK.encode("</think>The answer <think> again")
    return _plain(n - len(tail), seed) + tail


def _generation(arm, probe, mode, kl, floor, leak=False, loop=False, plan=PLAN) -> list[dict]:
    fam = LongGenFamily(_Arm(arm), None, TOK, None, plan)
    tokens = _tokens(len(kl), 7 * probe + len(arm), leak) if not loop else [11, 12, 13, 14] * (len(kl) // 4)
    reply = Reply(tokens, [], None, "length")
    return fam._rows(probe, mode, list(kl), list(floor)) + [
        fam._behaviour(probe, mode, 300, reply, Along(list(kl), list(floor), [1] * len(kl)))]


def _judge(rows):
    df = pd.DataFrame(rows)
    table = condition_table(df)
    t = longgen_table(df, table)
    return table, t, verdict_lines(table) + longgen_lines(t)


def _line(verdict, arm, mode):
    got = [v for v in verdict if v.startswith(f"`{arm}` (long generation, {mode},")]
    assert len(got) == 1, verdict                     # stated once
    return got[0]


def _even(seed, n=N, scale=1e-3):
    """A kernel that differs from the reference evenly: the same KL re-read and generated,
    up to noise of its own."""
    rng = np.random.default_rng(seed)
    floor = rng.lognormal(np.log(scale), 1.0, n)
    return floor * rng.lognormal(0, 0.3, n), floor


def _onset(at, n=N, level=0.5, seed=0):
    """Exact until step `at`, then a state gone bad; the re-read exact throughout."""
    kl = np.zeros(n)
    kl[at:] = level * np.random.default_rng(seed).lognormal(0, 0.5, n - at)
    return kl, np.zeros(n)


def test_stretches_start_at_step_zero():
    assert stretches(300, 16) == [(0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 300)]
    assert stretches(10, 16) == [(0, 10)]


def test_verdict_and_table_agree_flagged_and_not():
    """golden (exact; 1 of 2 sampled runs leaks), leaky (exact; 2 of 2 leak: the reported
    case, Fisher p = 0.5, not flagged), even (a kernel as far off re-read as generated, not
    flagged), early (onset at step 20, flagged): every run's verdict sentence says what the
    behaviour table decided, once, and the conditions table's stretches agree with it."""
    zero = np.zeros(N)
    rows = []
    for probe in range(2):
        rows += _generation("golden", probe, "greedy", zero, zero)
        rows += _generation("golden", probe, "sampled", zero, zero, leak=probe == 0)
        rows += _generation("leaky", probe, "greedy", zero, zero)
        rows += _generation("leaky", probe, "sampled", zero, zero, leak=True)
        for mode in ("greedy", "sampled"):
            rows += _generation("even", probe, mode, *_even(10 * probe + len(mode)))
            rows += _generation("early", probe, mode, *_onset(20, seed=probe))
    table, t, verdict = _judge(rows)
    t = t.set_index(["arm", "mode"])
    assert t.flagged.to_dict() == {(a, m): a == "early" for a in ("golden", "leaky", "even", "early")
                                   for m in ("greedy", "sampled")}
    for (arm, mode), r in t.iterrows():
        line = _line(verdict, arm, mode)
        assert ("is flagged:" in line) == r.flagged and ("is not flagged:" in line) == (not r.flagged), line
        assert r.why in line
        stretch = table[(table.arm == arm) & table.condition.str.startswith(mode + ":steps@")]
        assert stretch.flagged.any() == (r.stretches_flagged > 0)
    assert t.loc[("leaky", "sampled"), "leaks"] == 2 and t.loc[("leaky", "sampled"), "behaviour_p"] == 0.5
    assert "special tokens in the text in 2/2 vs 1/2 for `golden` (Fisher p=0.5)" in _line(verdict, "leaky", "sampled")
    assert not any("(longgen)" in v for v in verdict)        # no second statement from the conditions table


def test_early_onset_is_seen_and_dated_golden_and_even_never():
    """The floor is the re-read at the same positions, not the run's first 128 steps: an
    onset at step 20 is flagged from the 16-token stretch and dated at 20; one at 150 at 150;
    twenty even-numerics arms and the exact golden are never flagged."""
    zero = np.zeros(N)
    rows = _generation("golden", 0, "greedy", zero, zero)
    rows += _generation("early", 0, "greedy", *_onset(20))
    rows += _generation("late", 0, "greedy", *_onset(150))
    for s in range(20):
        rows += _generation(f"even{s}", 0, "greedy", *_even(s))
    table, t, _ = _judge(rows)
    t = t.set_index("arm")
    assert t.loc["early", "drift_start_min"] == 20 and t.loc["early", "first_flagged"] == 16
    assert t.loc["late", "drift_start_min"] == 150 and t.loc["late", "first_flagged"] == 128
    c = table.set_index(["arm", "condition"])
    assert not c.loc[("early", "greedy:steps@0"), "flagged"] and c.loc[("early", "greedy:steps@16"), "flagged"]
    assert not t.drop(index=["early", "late"]).flagged.any()
    assert t.drop(index=["early", "late"]).drift_start_min.isna().all()


def test_a_state_that_goes_bad_over_even_numerics_is_seen():
    """An arm off the reference evenly (KL ~1e-3 re-read and generated) whose generation
    goes 10x worse from step 40: flagged from there; the same arm without the step is not."""
    kl, floor = _even(3)
    worse = kl.copy()
    worse[40:] *= 10
    _, t, _ = _judge(_generation("even", 0, "greedy", kl, floor) + _generation("bad", 0, "greedy", worse, floor))
    t = t.set_index("arm")
    assert t.loc["bad", "flagged"] and t.loc["bad", "first_flagged"] == 32
    assert 40 <= t.loc["bad", "drift_start_min"] < 72
    assert not t.loc["even", "flagged"]


@pytest.mark.parametrize("k, flagged", [(2, False), (4, True)])
def test_misbehaviour_counts_are_judged_by_an_exact_test(k, flagged):
    """Loops in k of 4 greedy runs against none in the baseline's 4: 2 of 4 is p = 0.21 (not
    flagged), 4 of 4 is p = 0.014 (flagged); the baseline itself is counted, not judged."""
    zero = np.zeros(N)
    rows = []
    for probe in range(4):
        rows += _generation("golden", probe, "greedy", zero, zero, plan=LongGenPlan(probes=4, max_tokens=N))
        rows += _generation("loopy", probe, "greedy", zero, zero, loop=probe < k,
                            plan=LongGenPlan(probes=4, max_tokens=N))
    _, t, verdict = _judge(rows)
    r = t.set_index("arm").loc["loopy"]
    assert r.loops == k and r.flagged == flagged
    assert r.behaviour_p == pytest.approx({2: 3 / 14, 4: 1 / 70}[k])
    assert ("is flagged:" in _line(verdict, "loopy", "greedy")) == flagged
    assert not t.set_index("arm").loc["golden", "flagged"]
