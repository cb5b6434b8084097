"""BOS in an engine's own replies (issue 61): what argmax emits when a logits row is NaN
(vllm#41834 traced BOS leaking into 1 in 120 long generations to four NaN paths), and
non-finite logprobs reported beside a reply's tokens. Read from the token ids every stored
reply of the run holds (prefix, batch and long-generation probes), so a server that skips
special tokens when it detokenises cannot hide them, and only before a reply's first EOS:
probes generate past EOS, where a healthy model may well open a new turn or document. Any
one is a finding, whatever the floors. (Other special tokens are the spec family's, judged
against a baseline's replies.)"""
from __future__ import annotations

import math

import pandas as pd

COLUMNS = ["arm", "replies", "bos_replies", "nonfinite_replies"]


def special_counts(rows: pd.DataFrame, bos: int | None, eos: int | None) -> pd.DataFrame:
    """Per arm: replies with token ids, those holding BOS before their first EOS, those with a
    non-finite logprob among their reported distributions."""
    out = []
    if "tokens" not in rows:
        return pd.DataFrame(columns=COLUMNS)
    for arm, g in rows.groupby("arm", sort=False):
        n = bos_n = nf_n = 0
        for r in g.itertuples():
            toks = r.tokens if isinstance(r.tokens, list) else []
            if not toks:
                continue
            n += 1
            answer = toks[:toks.index(eos)] if eos in toks else toks
            bos_n += bos is not None and bos in answer
            nf_n += _nonfinite(getattr(r, "dists", None))
        out.append({"arm": arm, "replies": n, "bos_replies": bos_n, "nonfinite_replies": nf_n})
    return pd.DataFrame(out, columns=COLUMNS)


def _nonfinite(dists) -> bool:
    """Whether a stored reply's distributions ([[ids], [logp]] per step) hold NaN or +inf
    (-inf is a legitimate zero probability)."""
    if not isinstance(dists, list):
        return False
    return any(isinstance(v, float) and (math.isnan(v) or v == math.inf)
               for step in dists if isinstance(step, (list, tuple)) and len(step) == 2 for v in step[1])


def special_lines(counts: pd.DataFrame) -> list[str]:
    """A verdict line per arm whose replies hold BOS or a non-finite logprob."""
    lines = []
    for r in counts.itertuples():
        parts = []
        if r.bos_replies:
            parts.append(f"BOS (token 0, what argmax over a NaN logits row emits) in {r.bos_replies} of "
                         f"{r.replies} replies")
        if r.nonfinite_replies:
            parts.append(f"non-finite logprobs in {r.nonfinite_replies} of {r.replies} replies")
        if parts:
            lines.append(f"`{r.arm}`: " + "; ".join(parts) + " (never produced by a healthy engine)")
    return lines


def leaked(counts: pd.DataFrame) -> bool:
    return bool(len(counts) and counts[["bos_replies", "nonfinite_replies"]].to_numpy().sum() > 0)
