"""The command that made a report, as a user would type it: `fidelity <subcommand> ...`,
not the interpreter's path to the entry script (a machine path in a committed manifest)."""
from __future__ import annotations

import shlex
import sys


def command_line(prog: str = "fidelity") -> str:
    return shlex.join([prog, *sys.argv[1:]])
