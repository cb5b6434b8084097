"""Distributions as JSON for the probe store: a reference answer is stored once and read
back by a resumed run, so later comparisons use the very same reference."""
from __future__ import annotations

import numpy as np

from fidelity.scores.bounds import Known


def known_rows(ks: list[Known]) -> list[list]:
    return [[k.ids.tolist(), k.logp.tolist()] for k in ks]


def known_list(rows: list[list]) -> list[Known]:
    return [Known(np.asarray(i, np.int64), np.asarray(v, np.float64)) for i, v in rows]
