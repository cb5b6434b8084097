"""What a run did not get cleanly, stated rather than hidden: requests retried per arm and
route, and how many prompts each capture signal was computed on per arm (a capture that
failed for some prompts would otherwise shrink the indexer/expert signals silently)."""
from __future__ import annotations

from collections import Counter

import pandas as pd

CAPTURE_SIGNALS = {"indexer": "topk_loss, needle_lost", "experts": "expert_disagree"}


def offers_captures(scorer, scores: list) -> bool:
    """Whether captures are expected from this arm: computed here, offered by the server
    (known shape), or seen (or found missing) in any stored answer."""
    return (getattr(scorer, "kind", "") == "inprocess" or getattr(scorer, "shape", None) is not None
            or any(x.indexer is not None or x.captures_missing for x in scores))


def coverage_rows(name: str, role: str, base: list, arm: list, expected: bool) -> list[dict]:
    """Per capture signal: prompts where both the baseline and the arm have it, of all.
    `base`/`arm`: the stored scores, prompt by prompt."""
    reasons = sorted({x.captures_missing for x in base + arm if x.captures_missing})
    rows = []
    for field, signals in CAPTURE_SIGNALS.items():
        n = sum(getattr(b, field) is not None and getattr(a, field) is not None
                for b, a in zip(base, arm))
        rows.append({"arm": name, "role": role, "captures": field, "signals": signals,
                     "prompts": int(n), "of": len(arm), "expected": bool(expected),
                     "missing_because": "; ".join(reasons)[:300] if reasons else ""})
    return rows


def incomplete(cov: pd.DataFrame) -> pd.DataFrame:
    """Rows of arms whose captures were expected but cover fewer prompts than the run has."""
    if not len(cov):
        return cov
    return cov[cov.expected & (cov.prompts < cov["of"])]


def retry_summary(counts: dict[str, Counter]) -> dict:
    """{arm: {"total": n, "routes": {route: n}}} for arms that retried anything."""
    return {arm: {"total": sum(c.values()), "routes": dict(sorted(c.items()))}
            for arm, c in counts.items() if sum(c.values())}


def retry_line(summary: dict) -> str:
    """One console line, e.g. 'retries: engine 3 (POST /generate 2, GET /get_model_info 1)'."""
    parts = [f"{arm} {v['total']} (" + ", ".join(f"{r} {n}" for r, n in v["routes"].items()) + ")"
             for arm, v in summary.items()]
    return "retries: " + ("; ".join(parts) if parts else "none")
