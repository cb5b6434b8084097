"""A report's manifest records the command as typed (`fidelity kld ...`), never the
interpreter's path to the entry script, which is a machine path in a committed file."""
import sys

from infra.command import command_line


def test_the_command_is_written_as_typed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/tmp/wt3/fidelity/__main__.py", "kld", "--arm", "a=golden", "--note", "two words"])
    assert command_line() == "fidelity kld --arm a=golden --note 'two words'"
