"""Outcomes per length residue (ab and kld reports): which residues mod 4 (the smallest
compress ratio, fidelity.design.lengths) break, so "only lengths 3 mod 4 depart" reads off one
table instead of being averaged into a mean over every prompt.

A prompt *breaks* as the verdict's per-prompt tail test counts it (one definition,
fidelity.verdict.tail.broken): the arm's value at least 10x the largest floor's on that same
prompt. The verdict judges whether that many broken prompts could be noise; this table only
says where they are, so the two never disagree on a count."""
from __future__ import annotations

import pandas as pd

from ..design.lengths import Boundaries, label_length, period_label, residue_label
from .signals import mechanism_floors
from .tail import broken, judging_floors

COLUMNS = ["arm", "residue", "lengths", "prompts", "breaks", "mean", "max", "floor_max"]


def residue_table(sig: pd.DataFrame, prompt_length: dict[str, int], arms,
                  floors: list[str], b: Boundaries,
                  place: tuple[str, str] = ("answer_kld", "final logits")) -> pd.DataFrame:
    """Per arm and residue: the lengths there, prompts, how many break (tail.broken: at
    least 10x the floor that judges the arm on that prompt, tail.judging_floors, as the
    verdict's tail judges it), the signal's mean and max, and those floors' max. `arms`:
    names, or name -> factors (a schedule factor marks a scheduled arm); `sig`: tidy signals (arm, prompt, signal, where, value),
    as fidelity.verdict.signals makes them; `place`: the (signal, where) the table reads."""
    signal, where = place
    s = sig[(sig.signal == signal) & (sig["where"] == where)]
    if s.empty:
        return pd.DataFrame(columns=COLUMNS)
    v = s.pivot_table(index="prompt", columns="arm", values="value", aggfunc="first")
    factors = arms if isinstance(arms, dict) else {a: frozenset() for a in arms}
    judged = judging_floors(v, factors, floors, mechanism_floors(floors), signal)
    m = b.modulus
    rows = []
    for arm in [a for a in factors if a in v]:
        pf = judged.get(arm)
        by_res: dict[int, list[str]] = {}
        for p in v.index:
            if p in prompt_length and pd.notna(v.at[p, arm]):
                by_res.setdefault(prompt_length[p] % m, []).append(p)
        for r in sorted(by_res):
            ps = by_res[r]
            x = v.loc[ps, arm]
            rows.append({"arm": arm, "residue": f"{r} mod {m}",
                         "lengths": ",".join(map(str, sorted({prompt_length[p] for p in ps}))),
                         "prompts": len(ps), "breaks": int(broken(x, pf.value).sum()) if pf else 0,
                         "mean": float(x.mean()), "max": float(x.max()),
                         "floor_max": float(pf.value.loc[ps].max()) if pf else float("nan")})
    return pd.DataFrame(rows, columns=COLUMNS)


def broken_residues(table: pd.DataFrame, arm: str) -> list[str]:
    """Residues where a prompt of `arm` breaks (a bug conditional on length need not break
    every prompt there: the answer it moves may be one the needle barely depends on)."""
    t = table[(table.arm == arm) & (table.prompts > 0)]
    return list(t[t.breaks > 0].residue)


def grid_frame(lengths, b: Boundaries) -> pd.DataFrame:
    """One row per length: its residue, the boundary it sits at and every period of the
    config it is a multiple of (a residue is one period among several)."""
    return pd.DataFrame([{"length": L, "residue": residue_label(L, b.modulus),
                          "boundary": label_length(L, b), "periods": period_label(L, b)}
                         for L in sorted(set(lengths))],
                        columns=["length", "residue", "boundary", "periods"])


CAPTION = ("Per arm and length residue: a prompt *breaks* when the arm's answer KLD (where "
           "the answer is produced: the question's last token and the decode steps) is at least "
           "10x the floor judging it on that prompt (every floor's largest, never below their median "
           "over prompts; under a schedule the serving floors and the toggle's own one-shot value) -- "
           "the verdict's per-prompt count, so the two agree; "
           "the verdict says whether that many could be noise. A bug of one residue (vllm #55927: "
           "lengths 3 mod 4) moves only its row (max 0 in the others'); a residue is one period "
           "among several (the window, each ratio: docs/lengths.md).")
GRID_CAPTION = ("Each length's residue, the boundary it sits next to (the window, index_topk x ratio, "
                "multiples of the largest ratio) and every period of the config it is a whole multiple "
                "of (a bug tied to any of them acts there).")
