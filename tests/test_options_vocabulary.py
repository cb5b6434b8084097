"""One spelling per concept across the CLI (fidelity.commands.options.VOCABULARY): every long
option that two or more commands take is declared there with its meaning, a retired spelling
is accepted (with a note naming the new one) but never offered again, and the engines TOML's
task keys are the commands' own option names."""
import argparse

import pytest

from fidelity.cli import build_parser, main
from fidelity.commands.options import RETIRED, VOCABULARY

# spellings of a declared concept that must not come back as visible options
SYNONYMS = {"--inprocess": "--arm", "--arms": "--arm", "--prompts-per-length": "--reps", "--steps": "--decode-steps",
            "--trials": "--reps", "--num-prompts": "--reps", "--n-prompts": "--reps", "--max-new-tokens": "--max-tokens",
            "--output": "--out", "--output-dir": "--out", "--ckpt": "--checkpoint", "--url": "--endpoint"}


def visible_options() -> dict[str, dict[str, str]]:
    """command -> {long option: help} for every option a user sees in --help."""
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, sp in sub.choices.items():
        out[name] = {o: a.help or "" for a in sp._actions if a.help != argparse.SUPPRESS
                     for o in a.option_strings if o.startswith("--") and o != "--help"}
    return out


def test_every_shared_option_is_declared_once():
    seen: dict[str, list[str]] = {}
    for cmd, opts in visible_options().items():
        for o in opts:
            seen.setdefault(o, []).append(cmd)
    undeclared = {o: cmds for o, cmds in seen.items() if len(cmds) > 1 and o not in VOCABULARY}
    assert not undeclared, ("options shared by several commands must be declared once in "
                            f"fidelity/commands/options.py VOCABULARY with what they mean: {undeclared}")


def test_no_command_offers_a_retired_or_synonym_spelling():
    offenders = {(cmd, o) for cmd, opts in visible_options().items() for o in opts if o in SYNONYMS or o in RETIRED}
    assert not offenders, f"spell these as the vocabulary does ({SYNONYMS}): {sorted(offenders)}"


@pytest.mark.parametrize("old,new,argv", [
    ("--inprocess", "--arm", ["kld", "--inprocess", "golden=golden"]),
    ("--steps", "--decode-steps", ["kld", "--arm", "golden=golden", "--steps", "3"]),
    ("--arms", "--arm", ["ab", "--arms", "engine"]),
    ("--prompts-per-length", "--reps", ["ab", "--prompts-per-length", "2"]),
    ("--prompts", "--batch", ["plan-memory", "--preset", "flash", "--length", "8192", "--prompts", "2"]),
    ("--weights", "--weights-mode", ["plan-memory", "--preset", "flash", "--length", "8192", "--weights", "streamed"]),
])
def test_a_retired_spelling_still_parses_into_the_same_setting_with_a_note(old, new, argv, capsys):
    p = build_parser()
    got = p.parse_args(argv)
    note = capsys.readouterr().err
    assert f"note: {old} is now {new}" in note
    new_argv = [new if a == old else a for a in argv]
    want = p.parse_args(new_argv)
    assert capsys.readouterr().err == ""
    assert {k: v for k, v in vars(got).items() if k != "func"} == {k: v for k, v in vars(want).items() if k != "func"}


def test_the_engines_toml_task_keys_are_the_commands_option_names():
    from fidelity.engines.run import KLD_KEYS, NEEDLE_KEYS
    opts = visible_options()
    for cmd, keys in (("kld", KLD_KEYS), ("needle", NEEDLE_KEYS)):
        missing = sorted(k for k in keys if "--" + k.replace("_", "-") not in opts[cmd]
                         and "--" + k.replace("_", "-") not in RETIRED and k != "captures")
        assert not missing, f"[run.{cmd}] keys with no `fidelity {cmd}` option of that name: {missing}"


def test_plan_memory_refuses_an_arm_count_under_the_arm_option(capsys):
    assert main(["plan-memory", "--preset", "flash", "--length", "8192", "--arm", "2"]) == 2
    assert "--n-arms 2" in capsys.readouterr().err
