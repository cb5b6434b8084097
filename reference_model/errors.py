"""The golden's input error, shared by the model and its version parts."""
from __future__ import annotations


class InputError(ValueError):
    """Bad tokens or prompt length."""
