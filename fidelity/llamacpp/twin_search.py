"""Twin search: when llama.cpp departs from every modelled arm, which registered toggle, added
to its twin, reproduces it? Greedy, over the propagated taps of the replay: each candidate
(the current arm plus one toggle) runs over the same ids by the same path and joins the
modelled arms; it is scored by where the engine first departs from all of them, by the
replay's rule (further than FACTOR x the twin's floor from every one). The candidate that
moves that first departure furthest down the graph -- or, at the same tap, at least halves
the error there -- stays modelled, and the search goes on from it.
What no candidate moves is arithmetic no toggle models, named by its tap. On a planted bug the
toggle found names the bug's class (e.g. yarn_on_swa_layers for RoPE scaling on the wrong
layers); on a clean build it names arithmetic the twin is missing."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .replay import F32_ROUNDING, FACTOR, GOLDEN, compare, modelled, taps_of

# seams a forward over a prompt never crosses (requests, chat, cached-state restores, chunk
# boundaries, speculative verification): their toggles cannot change a replay
NOT_IN_A_FORWARD = {"chat_request", "chat_render", "state_restore", "chunk_boundary", "spec_verify",
                    "spec_rollback", "spec_accept"}
HALVES = 0.5


def candidates(arm: str, version: str = "v4") -> list[str]:
    """Registered toggles that can join `arm` (PROFILE:toggles): on this version, acting inside
    a forward, not already in the arm nor in a group one of its toggles holds, and accepted
    beside them (ToggleSet.parse)."""
    from kernel_toggles import ToggleSet, registry
    from kernel_toggles.registry import ToggleError
    have = ToggleSet.parse(arm.partition(":")[2], version)
    groups = {registry.get(n).group for n in have.names} - {None}
    out = []
    for t in registry.all_toggles():
        if (version not in t.versions or t.category not in ("optimization", "known-bug") or t.name in have
                or set(t.kernels) & NOT_IN_A_FORWARD or (t.group and t.group in groups)):
            continue
        try:
            ToggleSet.parse(f"{arm.partition(':')[2]},{t.name}", version)
        except (ToggleError, ValueError):
            continue
        out.append(t.name)
    return out


def first_off(errors: np.ndarray, floor: np.ndarray) -> int:
    """Index of the first tap further than FACTOR x the floor (floored at float32 rounding)
    from the engine; len(errors) when none is."""
    off = np.flatnonzero(errors > FACTOR * np.maximum(floor, F32_ROUNDING))
    return int(off[0]) if len(off) else len(errors)


def _tap(table: pd.DataFrame, k: int) -> dict | None:
    if k >= len(table):
        return None
    r = table.iloc[k]
    return {"layer": int(r.layer), "tensor": r.tensor, "engine_tensor": r.engine_tensor}


def search(engine: dict, weights, ids: list[int], path: str, table: pd.DataFrame, golden_taps, twin: str,
           steps: int = 2, progress=lambda msg: None) -> dict:
    """Greedy twin search from `twin` (the replay's `table` holds its errors and floor);
    at most `steps` toggles are added. Returns where the twin first departed, the toggles
    added, where the grown arm first departs (None: nowhere), every candidate tried and the
    result in words."""
    from fidelity.pipeline.model import arm_numerics
    floor = table["twin floor"].to_numpy()
    errs = table[modelled(table)].min(axis=1).to_numpy()           # the closest modelled arm, per tap
    k = start = first_off(errs, floor)
    arm, added, tried = twin, [], []
    for _ in range(steps):
        if k >= len(table):
            break
        best = None
        names = candidates(arm)
        for j, name in enumerate(names):
            spec = f"{arm},{name}"
            progress(f"  twin search: {name} ({j + 1}/{len(names)})")
            taps = taps_of(weights, arm_numerics(spec, "reference", {}, "v4"), ids, path)
            own = compare(engine, {GOLDEN: golden_taps, spec: taps}, weights.cfg.n_layers)[f"vs {spec}"].to_numpy()
            e = np.minimum(errs, own)
            row = {"arm": spec, "added": name, "first": first_off(e, floor), "error_there": float(e[k]),
                   "was": float(errs[k])}
            tried.append(row)
            better = row["first"] > k or row["error_there"] <= HALVES * errs[k]
            if better and (best is None or (row["first"], -row["error_there"]) > (best[0]["first"], -best[0]["error_there"])):
                best = (row, e)
        if best is None:
            break
        (row, errs), arm = best, best[0]["arm"]
        added.append(row["added"])
        k = row["first"]
    out = {"twin": twin, "from": _tap(table, start), "added": added, "arm": arm, "to": _tap(table, k),
           "tried": tried}
    return {**out, "sentence": sentence(out)}


def sentence(s: dict) -> str:
    """The search in words."""
    def at(t):
        return f"layer {t['layer']} {t['tensor']} ({t['engine_tensor']})"
    n = len({r["added"] for r in s["tried"]})
    if s["from"] is None:
        return "Twin search: not needed (llama.cpp stays within the twin's floor of a modelled arm at every tensor)."
    if not s["added"]:
        return (f"Twin search: none of the {n} registered toggles tried, added to the twin, moves its first "
                f"unexplained departure at {at(s['from'])} or halves the error there: arithmetic no toggle models.")
    how = " then ".join(s["added"])
    if s["to"] is None:
        return (f"Twin search: adding {how} to the twin reproduces llama.cpp at every tensor compared "
                f"(it departed at {at(s['from'])}): that arithmetic, or a bug of its kind.")
    return (f"Twin search: adding {how} to the twin moves its first unexplained departure from {at(s['from'])} "
            f"to {at(s['to'])}; no further toggle of the {n} tried moves it: arithmetic no toggle models there.")
