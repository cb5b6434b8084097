"""What a new user reads first: `fidelity --help` is whole sentences (not a cut-off
developer docstring), `toggles --category` reaches every category including `request`,
and `engines --help` says where the output goes."""
import re
import subprocess

import pytest

from fidelity.cli import main

from needle_util import ROOT, fidelity_cmd

REQUEST_TOGGLES = {"thinking_default_off", "effort_medium_dropped", "chat_sglang_0523", "chat_vllm_033",
                   "chat_template_v32"}          # kernel_toggles/request.py, docs/research/dsv4-architecture.md §3.3


def _help(*args) -> str:
    p = subprocess.run(fidelity_cmd(*args, "--help"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_top_level_help_is_whole_sentences():
    out = _help()
    description = out.split("\n\n")[1]              # usage, blank line, description
    text = " ".join(description.split())
    assert text.endswith(".") and "fidelity/commands" not in text and len(text) > 60
    assert "fidelity COMMAND --help" in out


@pytest.mark.parametrize("category", ["request", "optimization", "known-bug"])
def test_toggles_category_selects_each_category(capsys, category):
    assert main(["toggles", "--category", category]) == 0
    lines = capsys.readouterr().out.splitlines()
    col = lines[0].index("category")                              # header, rule, rows
    rows = [r for r in lines[2:] if r.strip()]
    cats = {r[col:].split()[0] for r in rows}
    names = {r.split()[0] for r in rows}
    assert cats == {category}
    if category == "request":
        assert names == REQUEST_TOGGLES
    else:
        assert not names & REQUEST_TOGGLES


def test_engines_help_names_the_output_folder():
    text = " ".join(_help("engines").split())
    assert re.search(r"--out DIR output folder: writes <out>/engines/<run-id>/ \(default: the spec's \[run\] out, "
                     r"else 'reports' in the current directory\)", text)


def test_every_subcommand_help_ends_with_examples_that_parse():
    """Each subcommand's --help ends with real examples, and each example is a command
    line the parser accepts (an example that no longer parses is a broken promise)."""
    import argparse
    import shlex

    from fidelity.cli import COMMANDS, build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in COMMANDS:
        sp = sub.choices[name]
        assert sp.epilog.startswith("examples:\n"), name
        lines = [ln.split("#")[0].strip() for ln in sp.epilog.splitlines()[1:] if ln.strip()]
        assert lines, name
        for line in lines:
            argv = shlex.split(line)
            assert argv[:2] == ["fidelity", name], line
            parser.parse_args(argv[1:])                      # raises SystemExit if it does not parse
        assert sp.format_help().rstrip().endswith(sp.epilog.rstrip().splitlines()[-1].rstrip())


def test_every_option_of_every_subcommand_has_help():
    """An option listed in --help with no word on what it does is a question every new user
    has to answer by reading the code."""
    import argparse

    from fidelity.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {a.option_strings[-1]}" for name, sp in sub.choices.items() for a in sp._actions
            if a.option_strings and not (a.help or "").strip()]
    assert not bare, f"options without help: {', '.join(bare)}"
