"""What every probe family shares: the arm it probes, the store its rows go to, the
tokenizer and config its prompts are built with, its plan, and -- for the families that
compare with one -- a reference computed here. A stored row's key is the family's
`key_prefix` (family, arm, plan) then the probe and the condition.

Before any probe request of a run, each family is `check`ed (a reference it needs, a
prompt length the probe template can be built at: a bad length is an error naming the
family and the option, not a failure minutes in) and says what it will `cost`."""
from __future__ import annotations

from dataclasses import dataclass

from fidelity.design.prompts import haystack_ids, prompt_seed

from .client import LiveArm
from .store import ProbeStore

SEARCH = 512             # how far past a length too short the shortest buildable one is looked for


class FamilyError(ValueError):
    """A family that cannot run as asked (no reference, no chunk size, a prompt too short)."""


@dataclass
class Cost:
    """What a family sends one arm: requests, prompt tokens (about: multi-turn and filler
    prompts are estimated) and generated tokens at most; `here`: tokens the reference
    computed here scores."""
    requests: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    here: int = 0

    def words(self, family: str) -> str:
        ref = f", {self.here} scored here" if self.here else ""
        return (f"{family} {self.requests} requests (about {self.prompt_tokens} prompt tokens, "
                f"up to {self.generated} generated{ref})")


class Family:
    name = ""                # the family's name in --families
    SALT: int | None = None  # prompt_seed's salt of its haystack probe prompts (None: it builds none)
    NEEDS_REFERENCE: str | None = None     # why it needs a reference computed here

    def __init__(self, arm: LiveArm, store: ProbeStore, tokenizer, cfg, plan, reference=None):
        self.arm, self.store, self.tok, self.cfg, self.plan = arm, store, tokenizer, cfg, plan
        self.reference = reference                # a scorer: score(ids, Request), .model

    @staticmethod
    def key_prefix(arm: str, plan) -> str:
        raise NotImplementedError

    def cost(self) -> Cost:
        raise NotImplementedError

    def _key(self, probe: int, condition: str) -> str:
        return f"{self.key_prefix(self.arm.name, self.plan)}{probe}|{condition}"

    def _need_reference(self) -> None:
        if self.NEEDS_REFERENCE and self.reference is None:
            raise FamilyError(f"the {self.name} family {self.NEEDS_REFERENCE}: give --arm golden=golden "
                              "(or another in-process arm)")

    # ---- probe prompts --------------------------------------------------------------------
    def length(self) -> int:
        """The probe prompts' length on this arm (--length)."""
        return self.plan.length

    def probe_ids(self, probe: int, n: int | None = None) -> list[int]:
        """Probe prompt `probe`: an exact-length needle haystack (needle depths spread over
        the probes), of this family's length unless `n`."""
        n = self.length() if n is None else n
        ids, _ = haystack_ids(self.tok, n, (probe + 0.5) / self.plan.probes * 100,
                              prompt_seed(self.plan.seed, n, probe, self.SALT))
        return ids

    def _unbuildable(self, n: int) -> str | None:
        """Why some probe prompt of n tokens cannot be built (None: every one can)."""
        if n < 1:
            return f"{n} tokens"
        for probe in range(self.plan.probes):
            try:
                self.probe_ids(probe, n)
            except ValueError as e:
                return str(e)
        return None

    def shortest(self, start: int) -> int | None:
        """The shortest length from `start` at which every probe prompt builds."""
        return next((n for n in range(max(start, 1), start + SEARCH) if self._unbuildable(n) is None), None)

    def check(self) -> None:
        """FamilyError, before any request, for what this family cannot run as asked."""
        self._need_reference()
        if self.SALT is None:
            return
        n = self.length()
        why = self._unbuildable(n)
        if why is not None:
            least = self.shortest(n + 1)
            fix = (f"--length {self.name}={least} is the shortest that builds here (the minimum varies "
                   "with the needle each length draws)" if least else f"give a longer --length {self.name}=N")
            raise FamilyError(f"the {self.name} family cannot build its {n}-token probe prompts: {why}; "
                              f"{fix}, or leave {self.name} out of --families")
