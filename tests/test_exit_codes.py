"""One exit-code convention for every command (fidelity.errors): 0 nothing found, 1 something
flagged, 2 bad input. The end-to-end tests of each command assert their own codes; here the
decisions that are not obvious from a run: kld with twins reads the twins (a by-design gap
to the golden is no finding), and torchrun's ranks exit 0 on a finding."""
from fidelity.cli import _under_torchrun
from fidelity.errors import CLEAN, FLAGGED, exit_code
from fidelity.kld.twin import flagged


def _twin(unexplained=False, mechanism=()):
    return {"unexplained": unexplained, "mechanism": list(mechanism)}


def test_kld_flags_what_the_twins_do_not_explain_and_nothing_by_design():
    named = {"named": [{"toggle": "engine"}]}
    assert flagged(named) and not flagged({"named": []})                       # no twin: the golden verdict
    assert not flagged({**named, "twins": [_twin()]})                          # by design: the twin explains it
    assert flagged({**named, "twins": [_twin(), _twin(unexplained=True)]})
    assert flagged({"named": [], "twins": [_twin(mechanism=[{"toggle": "engine"}])]})   # picks moved inside
    assert (exit_code(True), exit_code(False)) == (FLAGGED, CLEAN) == (1, 0)


def test_a_finding_under_torchrun_exits_0_and_says_so(monkeypatch, capsys):
    assert _under_torchrun(1) == 1 and _under_torchrun(2) == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert _under_torchrun(1) == 0 and _under_torchrun(2) == 2 and _under_torchrun(0) == 0
    assert "flagged (exit code 0 under torchrun" in capsys.readouterr().err


def test_a_crash_exits_3_never_1(monkeypatch, capsys):
    """An uncaught exception would exit 1 -- what a history, a bench or a CI gate reads as a
    finding (a kld run that crashed in its report once read as "flagged" to the llama.cpp
    bench). It exits CRASHED with the traceback instead."""
    from fidelity import cli
    from fidelity.commands import toggles
    from fidelity.errors import CRASHED

    def boom(args):
        raise KeyError("a bug of ours")
    monkeypatch.setattr(toggles, "run", boom)
    assert cli.main(["toggles"]) == CRASHED == 3
    err = capsys.readouterr().err
    assert "KeyError: 'a bug of ours'" in err and "internal error (exit 3)" in err
