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


class CommandError(Exception):
    """What the user did wrong, in one message (no "error: " prefix: the CLI adds it)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
