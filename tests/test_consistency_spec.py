"""The consistency `spec` family against real `fidelity serve` processes: servers decoding
speculatively (K = 2 with the golden and each planted spec bug as a named model; K = 1 with
an acceptance bug and ds4 #750's shape), one plain server as the baseline. The golden is
never flagged (greedy bit-identical, sampled seed-identical); each bug is flagged with its
first diverging step and the kind the evidence points to; a speculating baseline is
refused; the judge's pieces on hand-made replies."""
import json
import subprocess

import numpy as np

import pandas as pd
import pytest

from checkpoint_util import tiny_mtp_checkpoint
from needle_util import ROOT, fidelity_cmd, served
from test_report_pages import REPR, _cells, check_command, suggested
from fidelity.consistency.spec import first_diff, injected, off_top1, served_speculation
from fidelity.consistency.spec_judge import _looks_like, agreement, permutation_p, reference_acceptance
from fidelity.scores.bounds import Known

BUGS = ("verify_not_batch_exact", "rollback_keeps_rejected_compressor_rows", "verify_ignores_temperature",
        "verify_accepts_near_top")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_mtp_checkpoint(tmp_path_factory.mktemp("spec") / "tiny-mtp")


@pytest.mark.slow           # a minute or more on a busy 2-core machine: CI runs it in make test-slow
def test_spec_family_names_each_bug_and_never_the_golden(ckpt, tmp_path):
    base = ("--checkpoint", str(ckpt), "--page-size", "16")
    arms = ("--arm", "golden=golden") + tuple(a for b in BUGS for a in ("--arm", f"{b}={b}"))
    one = ("--arm", "accepts1=verify_accepts_near_top", "--arm", "bos1=correction_row_not_snapshotted")
    common = ("--families", "spec", "--probes", "2", "--max-tokens", "20", "--spec-seeds", "6",
              "--length", "spec=200", "--checkpoint", str(ckpt), "--out", str(tmp_path))
    with served("golden", extra=base + arms + ("--speculative-tokens", "2")) as (spec,), \
            served("golden", extra=base + one + ("--speculative-tokens", "1")) as (spec1,), \
            served("golden", extra=base) as (plain,):
        eps = [a for n in ("golden",) + BUGS for a in ("--endpoint", f"{n}={spec}", "--model", f"{n}={n}")]
        eps += [a for n in ("accepts1", "bos1") for a in ("--endpoint", f"{n}={spec1}", "--model", f"{n}={n}")]
        p = subprocess.run(fidelity_cmd(
            "consistency", *eps, "--endpoint", f"plain={plain}", "--spec-baseline", "plain", *common,
            "--run-id", "r"), cwd=ROOT, capture_output=True, text=True, timeout=1500)
        # a baseline that speculates itself is refused, naming how it was told
        bad = subprocess.run(fidelity_cmd(
            "consistency", "--endpoint", f"golden={spec}", "--endpoint", f"also={spec}", "--model", "also=golden",
            "--spec-baseline", "also", *common, "--run-id", "bad"),
            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "decodes speculatively itself" in bad.stderr, bad.stderr[-2000:]
    assert "speculative.enabled = True" in bad.stderr
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    t = pd.read_csv(tmp_path / "consistency" / "r" / "spec.csv").set_index("arm")
    assert set(t.index) == {"golden", *BUGS, "accepts1", "bos1"}
    g = t.loc["golden"]
    assert not g.flagged and g.greedy_bitwise == 2 and g.seed_identical == 12 and g.off_top1 == 0
    assert not t.loc["bos1"].flagged          # ds4 #750's shape needs two drafts: lossless at K = 1
    for bug in BUGS:
        assert t.loc[bug].flagged, bug
    assert t.loc["verify_not_batch_exact"].first_lp_step <= 2
    assert "not batch-exact" in t.loc["verify_not_batch_exact"].looks_like
    assert "rollback" in t.loc["rollback_keeps_rejected_compressor_rows"].looks_like
    for arm, k, ref in (("verify_accepts_near_top", 2, "golden"), ("accepts1", 1, "bos1")):   # the kind, with the K served
        r = t.loc[arm]
        assert r.flagged and r.off_top1 > r.base_off_top1 == 0 and r.k_served == k, arm
        assert "accepts drafts the target rejects" in r.looks_like and f"{k} draft" in r.looks_like, arm
        # its acceptance beside the lossless arm's at the same K: a correct verifier accepts less
        assert r.accept_reference == ref, arm
        rate = lambda s: int(s.split("/")[0]) / int(s.split("/")[1])       # noqa: E731
        assert rate(r.accept_first) > rate(t.loc[ref].accept_first), (arm, r.accept_first, t.loc[ref].accept_first)
        assert (r.p_accept_above < 0.05) == ("first draft is accepted in" in r.looks_like), arm
    for bug in BUGS[:3]:                     # their tokens are their own top-1: not acceptance
        assert t.loc[bug].off_top1 == 0, bug
    tmp = t.loc["verify_ignores_temperature"]
    assert tmp.greedy_bitwise == 2 and tmp.p_distribution < 0.05 and "does not sample" in tmp.looks_like
    lines = p.stdout
    assert "`golden` (spec, vs `plain`): lossless" in lines
    for bug in BUGS:
        assert f"`{bug}` (spec, vs `plain`) changes its replies (" in lines
    rep = tmp_path / "consistency" / "r"
    manifest = json.loads((rep / "manifest.json").read_text())
    assert any("acceptance length" in v.lower() for v in manifest["verdict"])
    cmds = suggested(rep)                                  # the next steps: the spec family again
    assert cmds and all("--families spec" in c and "--spec-baseline plain" in c for c in cmds)
    for c in cmds:
        check_command(c)
    bad = [c for c in _cells(rep) if REPR.search(c)]
    assert not bad, bad[:5]


def test_the_judges_pieces():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None and first_diff([1, 2], [1, 5]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2
    assert injected([5, 0, 7], [5, 6, 7], {0}) == [1] and injected([0], [0], {0}) == []
    assert agreement([[1, 2], [1, 2], [1, 3]]) == pytest.approx((1 + 0.5 + 0.5) / 3)
    same = [([[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 4], [5, 6]])] * 3
    assert permutation_p(same)[1] == 1.0
    collapsed = [([[1, 2, 3]] * 6, [[i, i + 1, i + 2] for i in range(6)])] * 3
    d, p = permutation_p(collapsed)
    assert d == 1.0 and p < 0.01


def test_acceptance_against_a_lossless_reference():
    # one-sided Fisher by hand: 12 accepted of 20 verifies, 10 drawn for the arm, P(X >= 9)
    from math import comb
    by_hand = (comb(12, 9) * comb(8, 1) + comb(12, 10) * comb(8, 0)) / comb(20, 10)
    assert reference_acceptance((10, 9), (10, 3)) == pytest.approx(by_hand)
    assert reference_acceptance((10, 3), (10, 9)) > 0.99                 # fewer accepted: not evidence
    more = "its first draft is accepted in 9/10 verifies"
    said = _looks_like(True, False, 3, [], 0, [], 2, accepts_more=more)  # no off-top-1 token, yet
    assert "accepts drafts the target rejects" in said and more in said and "2 drafts" in said
    assert "rollback" in _looks_like(True, False, 3, [], 0, [], 2)      # without it: the state


def test_off_top1_and_served_speculation():
    d = Known(np.array([4, 7, 9]), np.array([-0.5, -0.5, -2.0]))
    assert off_top1([4, 7, 9, 11], [d] * 4) == [2, 3]          # a tie is top-1; unreported is not
    assert served_speculation({"speculative": {"enabled": True, "num_speculative_tokens": 2}})["k"] == 2
    sg = served_speculation({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3})
    assert sg["on"] and sg["k"] == 3 and "EAGLE" in sg["how"]
    assert not served_speculation({"speculative_algorithm": None})["on"]
    assert served_speculation({"version": "0.33"}) is None        # vLLM: no way to tell


from reference_model.tokenizer import BOS, USER  # noqa: E402


@pytest.mark.parametrize("off,k,injected,lp_step,kind", [
    ([BOS], 2, [BOS], 3, "antirez/ds4 #750 class"),               # a zeroed correction row, K >= 2
    ([BOS], 1, [BOS], 3, "accepts drafts the target rejects"),    # at K = 1 no rollback can do it
    ([USER], 1, [USER], 2, "the special token(s) <｜User｜>"),     # named by the token emitted
    (["", ""], 2, [], 4, "accepts drafts the target rejects"),
    ([], 2, [USER], 5, "rollback"),                               # the row itself moved there
    ([], 2, [], 1, "not batch-exact"),
])
def test_the_kind_comes_from_the_evidence(off, k, injected, lp_step, kind):
    said = _looks_like(True, False, lp_step, off, 0, injected, k)
    assert kind in said
    if off:
        assert f"{k} draft" in said
