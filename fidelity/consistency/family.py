"""What every probe family shares: the arm it probes, the store its rows go to, the
tokenizer and config its prompts are built with, its plan, and -- for the families that
compare with one -- a reference computed here. A stored row's key is the family's
`key_prefix` (family, arm, plan) then the probe and the condition."""
from __future__ import annotations

from .client import LiveArm
from .store import ProbeStore


class FamilyError(ValueError):
    """A family that cannot run as asked (no reference, no chunk size, a prompt too short)."""


class Family:
    def __init__(self, arm: LiveArm, store: ProbeStore, tokenizer, cfg, plan, reference=None):
        self.arm, self.store, self.tok, self.cfg, self.plan = arm, store, tokenizer, cfg, plan
        self.reference = reference                # a scorer: score(ids, Request), .model

    @staticmethod
    def key_prefix(arm: str, plan) -> str:
        raise NotImplementedError

    def _key(self, probe: int, condition: str) -> str:
        return f"{self.key_prefix(self.arm.name, self.plan)}{probe}|{condition}"

    def _need_reference(self, family: str, why: str) -> None:
        if self.reference is None:
            raise FamilyError(f"the {family} family {why}: give --inprocess golden=golden (or "
                              "another in-process arm)")
