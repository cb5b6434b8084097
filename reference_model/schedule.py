"""Schedules: how a prompt reaches the model, as a serving engine feeds it.

An engine rarely prefills a prompt in one piece from an empty state: it splits long
prompts into chunks (chunked prefill), restores a cached prefix's state and prefills only
the rest (prefix-cache hit), or runs the tail one token at a time through the decode path.
The golden forward keeps its whole state explicit (SequenceState), so each of these is the
same computation in other pieces -- bit-identical to one-shot on CPU in the reference
profile -- and an engine's serving bug is a deviation at a segment boundary. A schedule
turns a prompt of n tokens into segments; Model.layer runs them in order and calls the
seam kernels `chunk_boundary` between chunks and `state_restore` where a cached prefix's
state is restored.

`batch(k)` computes the prompt in the same step as k-1 other sequences: the golden's
numerics do not depend on it, but an engine's kernel may be chosen by the step's token
count (split-K, tile sizes); a kernel reads that count from `batch_tokens()`. A server
running real requests side by side says how many tokens the other sequences bring to the
step with `co_batched(tokens)`; the step's count is then this sequence's plus theirs.

Spelling: `oneshot`, `chunked(N)`, `prefix_hit(P)`, `decode_from(P)`, `batch(k)`."""
from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

KINDS = ("oneshot", "chunked", "prefix_hit", "decode_from", "batch")
_RE = re.compile(r"^\s*([a-z_]+)\s*(?:\(\s*(-?\d+)\s*\))?\s*$")


class ScheduleError(ValueError):
    """A schedule that cannot be spelled or cannot take this prompt."""


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    phase: str = "prefill"
    restore: bool = False          # the state was saved and restored before this segment (a cache hit)


@dataclass(frozen=True)
class Schedule:
    kind: str = "oneshot"
    n: int = 0                     # chunk size (chunked) or prefix length (prefix_hit, decode_from)

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        m = _RE.match(text or "")
        if not m or m.group(1) not in KINDS:
            raise ScheduleError(f"unknown schedule {text!r}; valid: oneshot, chunked(N), "
                                "prefix_hit(P), decode_from(P), batch(k)")
        kind, arg = m.group(1), m.group(2)
        if kind == "oneshot":
            if arg is not None:
                raise ScheduleError("oneshot takes no argument")
            return cls()
        if arg is None:
            raise ScheduleError(f"{kind} needs a token count, e.g. {kind}(128)")
        if int(arg) < 1:
            raise ScheduleError(f"{kind}({arg}): the token count must be at least 1")
        return cls(kind, int(arg))

    @property
    def batch(self) -> int:
        """Sequences computed in one step with this one (1 unless batch(k))."""
        return self.n if self.kind == "batch" else 1

    def __str__(self) -> str:
        return self.kind if self.kind == "oneshot" else f"{self.kind}({self.n})"

    def cannot_apply(self, lengths) -> tuple[list[int], str]:
        """(the prompt lengths this schedule cannot feed as it says, why): a prefix or
        decode start not shorter than the prompt; chunks no shorter than every prompt (no
        boundary anywhere: the arm would be one-shot under another name). ([], "") if none."""
        lengths = sorted(set(int(n) for n in lengths))
        if self.kind in ("prefix_hit", "decode_from"):
            bad = [n for n in lengths if self.n >= n]
            return bad, f"the prefix ({self.n} tokens) must be shorter than the prompt" if bad else ""
        if self.kind == "chunked" and lengths and max(lengths) <= self.n:
            return lengths, f"a chunk of {self.n} tokens holds the whole prompt: no chunk boundary"
        return [], ""

    def segments(self, length: int) -> list[Segment]:
        """The prompt's pieces in order. A prefix or decode start must leave at least one
        token after it."""
        if self.kind in ("oneshot", "batch"):
            return [Segment(0, length)]
        if self.kind == "chunked":
            return [Segment(a, min(a + self.n, length)) for a in range(0, length, self.n)]
        if self.n >= length:
            raise ScheduleError(f"{self}: the prefix ({self.n} tokens) must be shorter than the "
                                f"prompt ({length} tokens)")
        if self.kind == "prefix_hit":
            return [Segment(0, self.n), Segment(self.n, length, restore=True)]
        return [Segment(0, self.n)] + [Segment(t, t + 1, "decode") for t in range(self.n, length)]


ONESHOT = Schedule()

_BATCH_TOKENS: ContextVar[int | None] = ContextVar("batch_tokens", default=None)
_MATES: ContextVar[int] = ContextVar("batch_mates", default=0)


def batch_tokens() -> int | None:
    """Tokens in the step being computed (this sequence's and its batch-mates'); None
    outside Model.layer. Only batch-dependent kernels read it."""
    return _BATCH_TOKENS.get()


@contextmanager
def in_step(tokens: int):
    """Model.layer: a step of this sequence's `tokens`, plus its batch-mates' (co_batched)."""
    token = _BATCH_TOKENS.set(tokens + _MATES.get())
    try:
        yield
    finally:
        _BATCH_TOKENS.reset(token)


@contextmanager
def co_batched(tokens: int):
    """The other sequences in this step bring `tokens` tokens (a server's continuous batch)."""
    token = _MATES.set(max(int(tokens), 0))
    try:
        yield
    finally:
        _MATES.reset(token)
