"""The one error a `fidelity` subcommand raises for what the user got wrong (a bad option
value, a missing file, options that do not go together). `fidelity.cli.main` prints
"error: <message>" on stderr and exits with `code` (2 unless said otherwise); nothing
below the commands prints an error and returns a status, or exits the process.

Library modules raise their own domain errors (ValueError subclasses such as PlanError,
WeightsDiffError, DeviceError); a command catches the ones its input can cause and raises
`CommandError(str(e)) from None`. A domain error that is always a usage error may subclass
CommandError itself (fidelity.weights.source.WeightsError), so it reaches the user the
same way from any depth."""
from __future__ import annotations

# Every subcommand's exit code: 0 when it finds nothing, 1 when it flags something (a named
# toggle, an engine unexplained by its twin, a flagged condition, lost recall, BOS in a reply:
# a CI gate), 2 on bad input or an unreachable server (CommandError), 3 when fidelity itself
# crashed (CRASHED). Commands that only report (plan, toggles list, serve, the llamacpp /
# mlxvlm histories) exit 0 when they did what was asked.
CLEAN, FLAGGED = 0, 1
CRASHED = 3         # an uncaught exception: Python would exit 1, which scripts read as FLAGGED


def exit_code(flagged: bool) -> int:
    """The exit code of a judging command: FLAGGED when it flagged anything, else CLEAN."""
    return FLAGGED if flagged else CLEAN


class CommandError(Exception):
    """What the user did wrong, in one message (no "error: " prefix: the CLI adds it)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
