"""The consistency `spec` family against real `fidelity serve` processes: one server
decoding speculatively (--speculative-tokens 2) with the golden and each planted spec bug
as a named model, one plain server as the baseline. The golden is never flagged (greedy
bit-identical, sampled seed-identical); each bug is flagged with its first diverging step
and the signature it looks like; the judge's pieces on hand-made replies."""
import json
import subprocess

import pandas as pd
import pytest

from checkpoint_util import tiny_mtp_checkpoint
from needle_util import ROOT, fidelity_cmd, served
from test_report_pages import REPR, _cells, check_command, suggested
from fidelity.consistency.spec import first_diff, injected
from fidelity.consistency.spec_judge import agreement, permutation_p

BUGS = ("verify_not_batch_exact", "rollback_keeps_rejected_compressor_rows", "verify_ignores_temperature")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_mtp_checkpoint(tmp_path_factory.mktemp("spec") / "tiny-mtp")


@pytest.mark.slow           # a minute or more on a busy 2-core machine: CI runs it in make test-slow
def test_spec_family_names_each_bug_and_never_the_golden(ckpt, tmp_path):
    base = ("--checkpoint", str(ckpt), "--page-size", "16")
    arms = ("--arm", "golden=golden") + tuple(a for b in BUGS for a in ("--arm", f"{b}={b}"))
    with served("golden", extra=base + arms + ("--speculative-tokens", "2")) as (spec,), \
            served("golden", extra=base) as (plain,):
        eps = [a for n in ("golden",) + BUGS for a in ("--endpoint", f"{n}={spec}", "--model", f"{n}={n}")]
        p = subprocess.run(fidelity_cmd(
            "consistency", *eps, "--endpoint", f"plain={plain}", "--spec-baseline", "plain",
            "--families", "spec", "--probes", "2", "--max-tokens", "20", "--spec-seeds", "6",
            "--length", "spec=200", "--checkpoint", str(ckpt), "--out", str(tmp_path), "--run-id", "r"),
            cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    t = pd.read_csv(tmp_path / "consistency" / "r" / "spec.csv").set_index("arm")
    assert set(t.index) == {"golden", *BUGS}
    g = t.loc["golden"]
    assert not g.flagged and g.greedy_bitwise == 2 and g.seed_identical == 12
    for bug in BUGS:
        assert t.loc[bug].flagged, bug
    assert t.loc["verify_not_batch_exact"].first_lp_step <= 2
    assert "not batch-exact" in t.loc["verify_not_batch_exact"].looks_like
    assert "rollback" in t.loc["rollback_keeps_rejected_compressor_rows"].looks_like
    tmp = t.loc["verify_ignores_temperature"]
    assert tmp.greedy_bitwise == 2 and tmp.p_distribution < 0.05 and "does not sample" in tmp.looks_like
    lines = p.stdout
    assert "`golden` (spec, vs `plain`): lossless" in lines
    for bug in BUGS:
        assert f"`{bug}` (spec, vs `plain`) changes its replies from generated step" in lines
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
