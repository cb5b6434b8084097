"""An engine's indexer picks against its twin's, fed the engine's own attention input: per CSA
layer the rows whose picks differ, judged on the twin's exact scores so a tie reordering is
never a finding.

Per row (a query whose k picks are all visible to the twin): T the twin's picks, E the
engine's. An entry the twin picks and the engine does not is *lost*, one the engine picks
instead is *gained*; the row's loss is the best lost entry's score minus the worst gained one's
(minus the twin's boundary, the best score it did not pick, when the engine gained none): what
the engine gave up, 0 for a tie reordered. A row departs when that loss exceeds the scores' own
floor: twice the largest difference between the twin's scores and the twin's in fp64 on that row
(either side of a swap can move by it). An engine that keeps fewer (or more) picks than k is
named so whatever its losses: that difference is itself the finding. With the needle's token positions, the entries that hold the
needle are followed on the last row (the answer's position): picked or not by each, and their
margin to the boundary (how close the selection is to changing what the answer can see)."""
from __future__ import annotations

import numpy as np
import torch

SLACK = 2.0                  # x the score floor (both sides of a swap move by up to one floor)


def scores_and_picks(model, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's indexer on input x, prefill from an empty cache: the exact scores (keys a row
    cannot see at -inf) and the picks [rows, k] (-1: none)."""
    from reference_model.taps import Taps
    got: list[torch.Tensor] = []
    m = model.with_numerics(model.nx.recording_index_scores(got.append))
    taps = Taps([f"layers.{i}.attn.index.topk"])
    m.attention(i, m._weights(i), torch.tensor(x).to(m.nx.cd), m.new_state(), 0,
                lambda name, v: taps.put(f"layers.{i}.{name}", v), "prefill")
    return torch.cat(got, 0).double().numpy(), taps[f"layers.{i}.attn.index.topk"].numpy()


def compare(engine: np.ndarray, twin: np.ndarray, s: np.ndarray, s64: np.ndarray,
            needle_entries: list[int] | None = None) -> dict:
    """Engine picks vs the twin's on one layer (module doc). `s`, `s64`: the twin's scores and
    the twin-in-fp64's [rows, keys]. Returns rows judged, rows whose picks differ as sets, rows
    departing beyond the floor, the worst row, and the needle's entries on the last row."""
    k = twin.shape[1]
    full = (twin >= 0).all(1)
    visible = np.isfinite(s)
    out = {"rows": int(full.sum()), "k": int(k), "engine_k": int(engine.shape[1]), "differ": 0, "beyond": 0,
           "worst": None}
    for j in np.flatnonzero(full):
        T = set(twin[j].tolist())
        E = {int(e) for e in engine[j] if 0 <= e < s.shape[1] and visible[j, e]}
        if E == T:
            continue
        out["differ"] += 1
        rest = np.where(visible[j], s[j], -np.inf)
        rest[list(T)] = -np.inf
        lost, gained = sorted(T - E, key=lambda e: -s[j, e]), E - T
        below = (min(s[j, g] for g in gained) if gained else
                 rest.max() if np.isfinite(rest.max()) else min(s[j, list(T)]))
        loss = float(s[j, lost[0]] - below) if lost else 0.0
        floor = float(np.abs(s[j][visible[j]] - s64[j][visible[j]]).max())
        beyond = loss > SLACK * floor
        out["beyond"] += int(beyond)
        if beyond and (out["worst"] is None or loss / max(floor, 1e-30) > out["worst"]["x_floor"]):
            out["worst"] = {"row": int(j), "lost": len(lost), "entry": int(lost[0]), "loss": loss,
                            "floor": floor, "x_floor": loss / max(floor, 1e-30)}
    if needle_entries:
        out["needle"] = needle(engine[-1], twin[-1], s[-1], needle_entries)
    return out


def needle(engine: np.ndarray, twin: np.ndarray, s: np.ndarray, entries: list[int]) -> dict:
    """The needle's compressed entries on one row: picked by the twin / the engine, and the best
    one's margin to the twin's boundary (positive: inside the twin's top-k by that much)."""
    vis = [e for e in entries if e < s.shape[0] and np.isfinite(s[e])]
    if not vis:
        return {"entries": [], "visible": False}
    T = set(twin[twin >= 0].tolist())
    rest = np.where(np.isfinite(s), s, -np.inf)
    kth = min(s[list(T)]) if T else -np.inf
    rest[list(T)] = -np.inf
    best = max(vis, key=lambda e: s[e])
    boundary = kth if best not in T else float(rest.max()) if np.isfinite(rest.max()) else kth
    return {"entries": vis, "visible": True, "twin_kept": bool(T & set(vis)),
            "engine_kept": bool(set(engine.tolist()) & set(vis)), "best": int(best),
            "margin": float(s[best] - boundary)}


def needle_entries(positions, ratio: int) -> list[int]:
    """The compressed entries (of a ratio-`ratio` compressor) holding any of `positions`."""
    return sorted({int(p) // ratio for p in positions})


def departs(rows: list[dict]) -> bool:
    """Whether any layer's picks depart from the twin's: beyond the scores' floor, or another
    pick count (fewer, or more: an index_topk override)."""
    return any(r["beyond"] or r["engine_k"] != r["k"] for r in rows)


def sentence(rows: list[dict], engine: str = "llama.cpp") -> str | None:
    """The selection finding in words ('' parts left out); None when no layer departs."""
    if not departs(rows):
        return None
    bad = [r for r in rows if r["beyond"]]
    fewer = [r for r in rows if r["engine_k"] != r["k"]]
    words = f"{engine}'s indexer selects other entries than its twin, fed the same inputs:"
    if fewer:
        words += (f" it keeps {fewer[0]['engine_k']} picks per row where the twin keeps {fewer[0]['k']} (layer"
                  f"{'s' if len(fewer) > 1 else ''} {', '.join(str(r['layer']) for r in fewer)})"
                  + (";" if bad else "."))
    if bad:
        w = max(bad, key=lambda r: r["worst"]["x_floor"])
        parts = ", ".join(f"{r['beyond']} of {r['rows']} rows at layer {r['layer']}" for r in bad)
        words += (f" {parts} lose an entry beyond the scores' floor (worst at layer {w['layer']}: it gives up "
                  f"{w['worst']['loss']:.3g} in score, {w['worst']['x_floor']:.3g}x the floor).")
    nd = [r for r in rows if (r.get("needle") or {}).get("visible")]
    if nd:
        lost = [r for r in nd if r["needle"]["twin_kept"] and not r["needle"]["engine_kept"]]
        close = min(nd, key=lambda r: abs(r["needle"]["margin"]))
        words += (" The needle's entry is lost at layer " + ", ".join(str(r["layer"]) for r in lost) + "."
                  if lost else " The needle's entry stays picked where the twin picks it")
        if not lost:
            words += (f"; its smallest margin to the boundary is {close['needle']['margin']:.3g} at layer "
                      f"{close['layer']}.")
    return words


def engine_picks(picks: np.ndarray):
    """An index_topk kernel returning the engine's own picks (rows x k) where an entry is
    visible to the in-process arm, -1 elsewhere (llama.cpp fills rows with fewer visible
    entries than k with indices its mask hides). An engine that keeps fewer picks per row
    than k has its rows padded with -1 (what it did not pick is not attended)."""
    def topk(golden, scores, k):
        p = np.asarray(picks)[:, :k]
        p = np.pad(p, ((0, 0), (0, k - p.shape[1])), constant_values=-1)
        idx = torch.tensor(p, dtype=torch.long, device=scores.device)
        seen = torch.gather(torch.isfinite(scores), 1, idx.clamp(0, scores.shape[1] - 1)) & (idx < scores.shape[1])
        return torch.where(seen, idx, torch.full_like(idx, -1)).sort(1).values
    return topk
