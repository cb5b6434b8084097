"""Two greedy replies to the same prompt, one served under a condition (a cache hit,
company in the batch) and one without: are they the same bit for bit, where do the
generated tokens part, and how far apart are the distributions before they part (KL lower
bounds of kld.bounds on what both sides reported)."""
from __future__ import annotations

import numpy as np

from fidelity.kld.bounds import compare

from .client import Reply


def bitwise_equal(a: Reply, b: Reply) -> bool:
    """Same tokens and the same logprob for every id either side reported."""
    if a.tokens != b.tokens or len(a.dists) != len(b.dists):
        return False
    for p, q in zip(a.dists, b.dists):
        if len(p.ids) != len(q.ids):
            return False
        op, oq = np.argsort(p.ids), np.argsort(q.ids)
        if not (np.array_equal(p.ids[op], q.ids[oq]) and np.array_equal(p.logp[op], q.logp[oq])):
            return False
    return True


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
