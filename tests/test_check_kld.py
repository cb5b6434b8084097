"""`fidelity check` gates a saved `fidelity kld` report as it gates an `ab` one (the README
says it gates reports): the same relative gate against the report's floors, the same
absolute thresholds and mechanism gate, read from the kld report's own tables; anything
else is one named error."""
import json

import pandas as pd
import pytest

from fidelity.cli import main


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kld")
    rc = main(["kld", "--arm", "golden=golden", "--arm", "engine=engine",
               "--arm", "bug=engine,routed_scaling_double", "--lengths", "250", "--depths", "50,90",
               "--decode-steps", "2", "--n-boot", "100", "--out", str(out), "--run-id", "r", "--quiet"])
    assert rc == 1                                   # flagged: the verdict names routed_scaling_double
    return out / "kld" / "r"


def _check(capsys, *args):
    rc = main(["check", *map(str, args)])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap.out, cap.err


def _signal(report, arm, signal):
    s = pd.read_csv(report / "signal_summary.csv")
    return s[(s.arm == arm) & (s.signal == signal)]["mean"]


def test_relative_gate_names_the_planted_bug(report, capsys):
    rc, out, _ = _check(capsys, report)
    assert rc == 1
    assert "FAIL bug: kld_mean" in out and "x worst floor" in out
    assert "2 arm(s) checked" in out                        # engine and bug; floors are not gated
    floors = [a["name"] for a in json.loads((report / "manifest.json").read_text())["manifest"]["arms"]
              if a["role"] == "floor"]
    assert floors and not any(f"FAIL {f}:" in out for f in floors)


def test_absolute_thresholds_read_the_kld_tables(report, capsys):
    by_pos = pd.read_csv(report / "kld_by_position.csv")
    engine = by_pos[(by_pos.arm == "engine") & (by_pos.bucket == "all")].iloc[0]
    rc, out, _ = _check(capsys, report, "--arm", "engine", "--max-kld", engine.kld_mean * 1.01)
    assert rc == 0 and "1 arm(s) checked, 0 failure(s)" in out
    rc, out, _ = _check(capsys, report, "--arm", "engine", "--max-kld", engine.kld_mean * 0.99)
    assert rc == 1 and "FAIL engine: kld_mean" in out
    recall = 1 - _signal(report, "engine", "topk_loss").max()
    rc, out, _ = _check(capsys, report, "--arm", "engine", "--min-topk-recall", recall + 0.001)
    assert rc == 1 and "FAIL engine: indexer top-k recall" in out
    rc, out, _ = _check(capsys, report, "--arm", "engine", "--min-topk-recall", recall - 0.001)
    assert rc == 0


def test_mechanism_gate_on_a_kld_report(report, capsys):
    rc, out, _ = _check(capsys, report, "--arm", "bug", "--mechanism", "--kld-x-floor", "1e9")
    assert rc == 1 and "FAIL bug: expert_same_min" in out


def test_a_folder_that_is_no_report_is_a_named_error(tmp_path, capsys):
    rc, _, err = _check(capsys, tmp_path)
    assert rc == 2 and "is not a `fidelity ab` or `fidelity kld` report" in err
