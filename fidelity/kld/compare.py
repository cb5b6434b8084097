"""Baseline vs arm for one prompt: per-position KL bounds, top-1 agreement and Δp over the
prompt ('prefill' phase; `path` says whether the arm computed a position in a prefill or,
like llama.cpp's teacher-forced reading, one token at a time) and along the greedy decode ladder up to the first step where the two
greedy continuations part (later steps are conditioned on different text); indexer top-k
overlap and expert agreement per layer from captures; whether the needle's compressed
entry is still picked at the last prompt position."""
from __future__ import annotations

import numpy as np

from needle.haystack import needle_entries

from fidelity.scores.bounds import compare
from fidelity.scores.dialects import PromptScores


def position_rows(base: PromptScores, arm: PromptScores) -> tuple[list[dict], int | None]:
    """Rows {phase, step, position, kl_lb, ...}; and the first ladder step whose greedy
    token differs (None when they agree throughout)."""
    n = len(base.ids)
    rows = []
    for j in range(n):
        actual = base.ids[j + 1] if j + 1 < n else None
        rows.append({"phase": "prefill", "step": 0, "position": j, "path": _path(arm, j),
                     **compare(base.known[j], arm.known[j], actual)})
    first = None
    steps = min(len(base.ladder), len(arm.ladder))
    for t in range(1, steps):                         # ladder[0] is prompt position n-1
        rows.append({"phase": "decode", "step": t, "position": n - 1 + t, "path": "decode",
                     **compare(base.ladder[t], arm.ladder[t], None)})
        if base.ladder_tokens[t] != arm.ladder_tokens[t]:
            break
    for t in range(min(len(base.ladder_tokens), len(arm.ladder_tokens))):
        if base.ladder_tokens[t] != arm.ladder_tokens[t]:
            first = t
            break
    return rows, first


def _path(arm: PromptScores, j: int) -> str:
    """How the arm computed prompt position j: 'decode' when its server evaluated that one
    token alone on a cached prefix (llama.cpp's teacher-forced reading), else 'prefill'."""
    ev = arm.evaluated
    return "decode" if ev is not None and j < len(ev) and ev[j] == 1 else "prefill"


def capture_rows(base: PromptScores, arm: PromptScores, csa_layers: list[int], n_layers: int,
                 needle_tokens=(), ratios: list[int] | None = None) -> list[dict]:
    """Per layer, over the prompt's positions: indexer recall of the baseline's picks,
    expert-set agreement; the needle entry picked by the baseline at the last position
    but not by the arm, at the layer's compress ratio (`ratios` per layer; None: V4's 4)."""
    if base.indexer is None or arm.indexer is None:
        return []
    n = len(base.ids)
    rows = []
    for c, layer in enumerate(csa_layers):
        b, a = base.indexer[:n, c], arm.indexer[:n, c]
        rec = []
        for bi, ai in zip(b, a):
            want = set(bi[bi >= 0].tolist())
            if want:
                rec.append(len(want & set(ai[ai >= 0].tolist())) / len(want))
        rows.append({"layer": layer, "signal": "topk_loss", "value": 1 - float(np.mean(rec)) if rec else 0.0})
        ratio = ratios[layer] if ratios else 4
        held = needle_entries(needle_tokens, n - 1, ratio) if len(needle_tokens) else []
        if held:
            bp, ap = set(b[-1].tolist()), set(a[-1].tolist())
            lost = any(j in bp for j in held) and not any(j in ap for j in held)
            rows.append({"layer": layer, "signal": "needle_lost", "value": float(lost)})
    for layer in range(n_layers):
        same = [set(x.tolist()) == set(y.tolist()) for x, y in
                zip(base.experts[:n, layer], arm.experts[:n, layer])]
        rows.append({"layer": layer, "signal": "expert_disagree", "value": 1 - float(np.mean(same))})
    return rows
