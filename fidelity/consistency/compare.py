"""Two answers to the same prompt, one served under a condition (a cache hit, company in
the batch) and one without: are they the same bit for bit, where do the generated tokens
part, and how far apart are the distributions before they part (KL lower bounds of
kld.bounds on what both sides reported). Greedy replies (`Reply`, no prompt logprobs) or
kld's `PromptScores` (prompt logprobs too, then the greedy ladder)."""
from __future__ import annotations

import numpy as np

from fidelity.scores.bounds import Known, compare
from fidelity.scores.dialects import PromptScores

from .client import Reply


def same_dists(a: list[Known], b: list[Known]) -> bool:
    """The same logprob for every id either side reported, position by position."""
    if len(a) != len(b):
        return False
    for p, q in zip(a, b):
        if len(p.ids) != len(q.ids):
            return False
        op, oq = np.argsort(p.ids), np.argsort(q.ids)
        if not (np.array_equal(p.ids[op], q.ids[oq]) and np.array_equal(p.logp[op], q.logp[oq])):
            return False
    return True


def bitwise_equal(a: Reply, b: Reply) -> bool:
    """Same tokens and the same logprob for every id either side reported."""
    return a.tokens == b.tokens and same_dists(a.dists, b.dists)


def compare_replies(ref: Reply, got: Reply) -> dict:
    """bitwise (bool), first_diff (first generated index whose token differs, None when
    none), kl_first (KL(ref||got) lower bound before the first generated token), kl_max
    (largest bound up to and including first_diff: after it the two are conditioned on
    different text), same_top1_first."""
    first = next((t for t, (x, y) in enumerate(zip(ref.tokens, got.tokens)) if x != y), None)
    if first is None and len(ref.tokens) != len(got.tokens):
        first = min(len(ref.tokens), len(got.tokens))
    upto = len(ref.dists) if first is None else first + 1
    cmp = [compare(p, q, None) for p, q in zip(ref.dists[:upto], got.dists[:upto])]
    kls = [c["kl_lb"] for c in cmp]
    return {"bitwise": bitwise_equal(ref, got), "first_diff": first,
            "kl_first": kls[0] if kls else float("nan"), "kl_max": max(kls) if kls else float("nan"),
            "same_top1_first": bool(cmp[0]["same_top1"]) if cmp else None}


def compare_scores(ref: PromptScores, got: PromptScores) -> dict:
    """compare_replies' fields for scored prompts (the ladder as the reply, its first
    distribution the last prompt position's), plus kl_prompt_max over the prompt positions."""
    as_reply = lambda s: Reply(s.ladder_tokens, s.ladder, None, "")          # noqa: E731
    out = compare_replies(as_reply(ref), as_reply(got))
    kl = [compare(p, q, None)["kl_lb"] for p, q in zip(ref.known[:-1], got.known[:-1])]
    out["bitwise"] = out["bitwise"] and same_dists(ref.known, got.known)
    out["kl_prompt_max"] = max(kl) if kl else 0.0
    return out
