"""The per-token tail: positions whose KL is far beyond what the floors reach at that same
position. vllm#41985 was an FP4 rounding-boundary bug on 0.03% of tokens, in most requests:
a mean over positions, its p99 and the per-prompt tail all average it away. Here a position
spikes when its KL is at least SPIKE times the larger of the floors' KL at that position and
the floors' median KL over the run; an arm's share of spiking positions in each prompt is the
signal `kl_spikes`, judged like any outcome signal against the floors' own shares (each floor
counted against the other floors, a lone floor against its own median), so a bug on a few
tokens of many prompts is named while noise, which spikes as often as the floors do, is not."""
from __future__ import annotations

import numpy as np
import pandas as pd

SPIKE = 1000.0          # far beyond any floor at that position: a wrong token, not a wobble
LEVEL_EPS = 1e-9        # the floors' median never counts as below this (an exact repeat is 0)
SIGNAL = "kl_spikes"


def spike_shares(pos: pd.DataFrame, floors: list[str]) -> pd.DataFrame:
    """(arm, prompt, value: share of the prompt's teacher-forced positions that spike, spikes,
    positions) for every arm of the positions table; empty without a floor arm. A
    non-finite KL is the `nonfinite` signal's, never a spike."""
    pre = pos[pos.phase == "prefill"]
    wide = pre.pivot_table(index=["prompt", "position"], columns="arm", values="kl_lb", aggfunc="first")
    present = [f for f in floors if f in wide.columns]
    if not present:
        return pd.DataFrame(columns=["arm", "prompt", "value", "spikes", "positions"])
    rows = []
    for arm in wide.columns:
        others = [f for f in present if f != arm]
        # a lone floor is judged against its own run median, never its own value there
        ref = (np.maximum(wide[others].max(axis=1), _level(wide[others])) if others
               else pd.Series(_level(wide[[arm]]), index=wide.index))
        kl = wide[arm]
        spikes = (kl >= SPIKE * ref) & np.isfinite(kl)
        for prompt, hit in spikes.groupby(level="prompt"):
            n = int(kl.loc[prompt].notna().sum())
            rows.append({"arm": arm, "prompt": prompt, "value": float(hit.sum()) / max(n, 1),
                         "spikes": int(hit.sum()), "positions": n})
    return pd.DataFrame(rows)


def _level(floors: pd.DataFrame) -> float:
    """The floors' median KL over every position of the run (finite values)."""
    v = floors.to_numpy(float).ravel()
    v = v[np.isfinite(v)]
    return max(float(np.median(v)) if len(v) else 0.0, LEVEL_EPS)
