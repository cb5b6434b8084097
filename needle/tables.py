"""Tidy tables from result rows: recall per cell with Wilson intervals, outcome counts,
paired McNemar between arms, token-count residuals and the indexer mechanism.

Recall trials are the scored outcomes (see scoring.SCORED); truncated and server-error
rows are counted beside them. Pairs for McNemar are trials where both arms produced a
scored outcome; "correct" is the paired binary variable."""
from __future__ import annotations

import statistics
from collections import defaultdict

from .scoring import BOS_TEXT, OUTCOMES, SCORED
from .stats import mcnemar, wilson

ALPHA = 0.05


def _arms(rows) -> list[str]:
    """Arms in row order: the sweep returns rows in runner order, so the first arm is the
    baseline (A) of every paired comparison."""
    seen: list[str] = []
    for r in rows:
        if r["arm"] not in seen:
            seen.append(r["arm"])
    return seen


def _summ(rs: list[dict]) -> dict:
    scored = [r for r in rs if r["outcome"] in SCORED]
    k = sum(r["recall"] for r in scored)
    n = len(scored)
    lo, hi = wilson(k, n)
    d = {"n": len(rs), "n_scored": n, "recall": (k / n) if n else None,
         "ci_low": lo if n else None, "ci_high": hi if n else None}
    for o in OUTCOMES:
        d[o] = sum(1 for r in rs if r["outcome"] == o)
    return d


def cells(rows) -> list[dict]:
    g = defaultdict(list)
    for r in rows:
        g[(r["arm"], r["length"], r["depth"])].append(r)
    order = {a: i for i, a in enumerate(_arms(rows))}
    return [{"arm": a, "length": L, "depth": d, **_summ(rs)}
            for (a, L, d), rs in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2]))]


def by_length(rows) -> list[dict]:
    g = defaultdict(list)
    for r in rows:
        g[(r["arm"], r["length"])].append(r)
    order = {a: i for i, a in enumerate(_arms(rows))}
    return [{"arm": a, "length": L, **_summ(rs)}
            for (a, L), rs in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def by_residue(rows, modulus: int = 4) -> list[dict]:
    """Recall per arm and length residue mod `modulus` (4: V4's ratio-4 compressor groups),
    so a bug of one residue (vllm #55927: lengths 3 mod 4) shows in its own row."""
    g = defaultdict(list)
    for r in rows:
        g[(r["arm"], r["length"] % modulus)].append(r)
    order = {a: i for i, a in enumerate(_arms(rows))}
    return [{"arm": a, "residue": f"{k} mod {modulus}",
             "lengths": ",".join(map(str, sorted({r["length"] for r in rs}))), **_summ(rs)}
            for (a, k), rs in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def needle_distance(r: dict) -> int | None:
    """Tokens from the needle value's last token to the prompt's last token (in-process
    rows, which record the value's token positions); None when unknown."""
    pos = r.get("value_token_positions")
    n = r.get("n_tokens")
    return n - 1 - max(pos) if pos and isinstance(n, int) else None


def by_window(rows, window: int) -> list[dict]:
    """Recall per arm with the needle inside the last query's sliding window (distance
    <= window - 1) or outside it (only in the compressed entries); rows without token
    positions (endpoints) are left out."""
    g = defaultdict(list)
    for r in rows:
        d = needle_distance(r)
        if d is not None:
            g[(r["arm"], "inside" if d <= window - 1 else "outside")].append((d, r))
    order = {a: i for i, a in enumerate(_arms(rows))}
    return [{"arm": a, "window": window, "side": side, "distance_min": min(d for d, _ in ds),
             "distance_max": max(d for d, _ in ds), **_summ([r for _, r in ds])}
            for (a, side), ds in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def kind_label(r: dict) -> str:
    """multikey with near-duplicate distractor keys is its own kind in the tables."""
    k = r.get("kind", "single")
    return k + "/near" if r.get("distractor_mode") == "near" else k


def by_kind(rows) -> list[dict]:
    """Per arm and kind: recall (found fraction, RULER's string match) beside the share of
    trials with every value found, which is what tells a multiquery miss of one needle from
    a miss of all."""
    g = defaultdict(list)
    for r in rows:
        g[(r["arm"], kind_label(r))].append(r)
    order = {a: i for i, a in enumerate(_arms(rows))}
    out = []
    for (a, k), rs in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        d = _summ(rs)
        n_exp = [len(r.get("expected") or ()) for r in rs]
        out.append({"arm": a, "kind": k, **d, "values_per_trial": max(n_exp, default=0),
                    "all_found_rate": d["correct"] / d["n_scored"] if d["n_scored"] else None})
    return out


def by_arm(rows) -> list[dict]:
    out = []
    for a in _arms(rows):
        rs = [r for r in rows if r["arm"] == a]
        res = [r["token_residual"] for r in rs if isinstance(r.get("token_residual"), int)]
        lat = [r["latency_s"] for r in rs if isinstance(r.get("latency_s"), (int, float))]
        out.append({"arm": a, **_summ(rs),
                    "exact_length_rate": sum(1 for r in rs if r.get("exact_length")) / len(rs),
                    "residual_max_abs": max((abs(x) for x in res), default=None),
                    "residual_mean": statistics.fmean(res) if res else None,
                    "latency_median_s": statistics.median(lat) if lat else None,
                    "retried_rows": sum(1 for r in rs if (r.get("attempts") or 1) > 1),
                    **_specials(rs)})
    return out


def _specials(rs: list[dict]) -> dict:
    """How many of an arm's replies carry BOS (token 0: a NaN logits row's argmax), how
    many of those only in reasoning_content, and how many any special token."""
    bos = [r for r in rs if any(BOS_TEXT in v for v in (r.get("specials") or {}).values())]
    return {"bos_replies": len(bos),
            "bos_reasoning_only": sum(1 for r in bos if BOS_TEXT not in r["specials"].get("response", [])),
            "special_replies": sum(1 for r in rs if r.get("specials"))}


def specials_leaked(arms: list[dict]) -> list[str]:
    """The arms of a by_arm table with BOS in any reply (content or reasoning): what `fidelity
    needle` flags beside lost recall (its exit code). A reply never carries BOS on a sound server."""
    return [a["arm"] for a in arms if a["bos_replies"]]


def pairs(rows) -> list[dict]:
    """McNemar of the first arm (A) against each other arm (B): per cell, per length, all."""
    arms = _arms(rows)
    if len(arms) < 2:
        return []
    idx = {(r["arm"], r["trial_id"]): r for r in rows}
    a = arms[0]
    out = []
    for b in arms[1:]:
        groups = defaultdict(list)
        for r in rows:
            if r["arm"] != a or (b, r["trial_id"]) not in idx:
                continue
            rb = idx[(b, r["trial_id"])]
            if r["outcome"] not in SCORED or rb["outcome"] not in SCORED:
                continue
            pair = (r["outcome"] == "correct", rb["outcome"] == "correct")
            groups[("cell", r["length"], r["depth"])].append(pair)
            groups[("length", r["length"], None)].append(pair)
            groups[("all", None, None)].append(pair)
        for (scope, L, d), ps in sorted(groups.items(), key=lambda kv: (
                ("cell", "length", "all").index(kv[0][0]), kv[0][1] or 0, kv[0][2] or 0)):
            m = mcnemar([x for x, _ in ps], [y for _, y in ps])
            out.append({"arm_a": a, "arm_b": b, "scope": scope, "length": L, "depth": d,
                        "n_pairs": m.n, "a_only": m.a_only, "b_only": m.b_only,
                        "recall_a": sum(x for x, _ in ps) / m.n, "recall_b": sum(y for _, y in ps) / m.n,
                        "delta": m.delta, "p_value": m.p_value, "test": m.test,
                        "significant": m.p_value < ALPHA})
    return out


def recall_lost(rows) -> list[str]:
    """The arms whose recall is below the first arm's over all their paired trials by the
    paired test (McNemar at ALPHA): what `fidelity needle` flags (its exit code)."""
    return [p["arm_b"] for p in pairs(rows)
            if p["scope"] == "all" and p["significant"] and p["recall_b"] < p["recall_a"]]


def mechanism(rows) -> list[dict]:
    """Per arm and CSA layer: how often the indexer kept an entry holding the needle in
    its top-k at the question position (trials where the needle is outside the window and
    already compressed), overall and split by correct vs not."""
    g = defaultdict(list)
    for r in rows:
        for m in r.get("mechanism") or []:
            if m.get("in_topk") is None or m.get("in_window"):
                continue
            g[(r["arm"], m["layer"])].append((m, r["outcome"] == "correct"))
    order = {a: i for i, a in enumerate(_arms(rows))}
    out = []
    for (a, layer), ms in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        hit = [m["in_topk"] for m, _ in ms]
        ranks = [m["best_rank"] for m, _ in ms if m["best_rank"] is not None]
        every = [m.get("values_in_topk", m["in_topk"]) == m.get("n_values", 1) for m, _ in ms]
        ok = [m["in_topk"] for m, c in ms if c]
        bad = [m["in_topk"] for m, c in ms if not c]
        lo, hi = wilson(sum(hit), len(hit))
        margins = [m["margin"] for m, _ in ms if m.get("margin") is not None]
        out.append({"arm": a, "layer": layer, "n": len(ms), "in_topk_rate": sum(hit) / len(hit),
                    "margin_median": statistics.median(margins) if margins else None,
                    "ci_low": lo, "ci_high": hi, "median_rank": statistics.median(ranks) if ranks else None,
                    "topk": ms[0][0]["topk"], "all_values_in_topk_rate": sum(every) / len(every),
                    "in_topk_rate_correct": sum(ok) / len(ok) if ok else None,
                    "in_topk_rate_missed": sum(bad) / len(bad) if bad else None})
    return out


def mechanism_pairs(rows) -> list[dict]:
    """First arm (A) against each other arm (B), per CSA layer, on the same trials: mean
    Jaccard of the indexer's picks at the question position, and McNemar on "an entry
    holding the needle is in top-k" (a_only: A kept the needle, B lost it), and how close
    A's needle entries sit to the boundary against B's shift of them (_fragility); then
    the same over trials x CSA layers pooled (layer "all")."""
    arms = [a for a in _arms(rows) if any(r.get("mechanism") for r in rows if r["arm"] == a)]
    if len(arms) < 2:
        return []
    mech = {(r["arm"], r["trial_id"]): {m["layer"]: m for m in r["mechanism"]}
            for r in rows if r.get("mechanism")}
    a = arms[0]
    out = []
    for b in arms[1:]:
        per = defaultdict(list)
        for (arm, tid), ma in mech.items():
            if arm != a or (b, tid) not in mech:
                continue
            for layer, x in ma.items():
                y = mech[(b, tid)].get(layer)
                if y is None or x.get("in_topk") is None or x.get("in_window"):
                    continue
                pa, pb = set(x.get("picks", [])), set(y.get("picks", []))
                jac = len(pa & pb) / len(pa | pb) if pa | pb else 1.0
                shift = (abs(y["margin"] - x["margin"])
                         if x.get("margin") is not None and y.get("margin") is not None else None)
                per[layer].append((x["in_topk"], y["in_topk"], jac, x.get("margin"), shift))
        layers = sorted(per.items())
        if len(layers) > 1:                  # a rare loss needs every trial: pooled over layers
            layers.append(("all", [p for _, v in layers for p in v]))
        for layer, v in layers:
            m = mcnemar([p[0] for p in v], [p[1] for p in v])
            out.append({"arm_a": a, "arm_b": b, "layer": layer, "n": m.n,
                        "picks_jaccard_mean": statistics.fmean(p[2] for p in v),
                        "identical_picks": sum(1 for p in v if p[2] == 1.0),
                        "a_only": m.a_only, "b_only": m.b_only, "p_value": m.p_value, "test": m.test,
                        **_fragility(v)})
    return out


def _fragility(v) -> dict:
    """B's median shift of the needle entry's margin against A's on the same trial, and
    the share of A's margins within twice that shift: needle entries one typical B-sized
    perturbation from changing sides of the top-k boundary (fidelity.ab.margins)."""
    shifts = [p[4] for p in v if p[4] is not None]
    if not shifts:
        return {"margin_shift_median": None, "fragile_rate": None}
    typical = statistics.median(shifts)
    a_margins = [p[3] for p in v if p[3] is not None]
    return {"margin_shift_median": typical,
            "fragile_rate": sum(abs(x) < 2 * typical for x in a_margins) / len(a_margins)}


def errors(rows) -> list[dict]:
    g = defaultdict(int)
    for r in rows:
        if r["outcome"] == "server_error":
            msg = (r.get("error") or "").split(":")[0][:60]
            g[(r["arm"], msg)] += 1
    return [{"arm": a, "error": e, "count": n} for (a, e), n in sorted(g.items())]


def all_tables(rows, modulus: int = 4, window: int | None = None) -> dict[str, list[dict]]:
    """Every table; `modulus`: the residue of the per-residue table; `window` (the model's
    sliding window, when known): recall inside vs outside it."""
    return {"arms": by_arm(rows), "kinds": by_kind(rows), "cells": cells(rows), "lengths": by_length(rows),
            "residues": by_residue(rows, modulus),
            "window": by_window(rows, window) if window else [],
            "pairs": pairs(rows), "mechanism": mechanism(rows),
            "mechanism_pairs": mechanism_pairs(rows), "errors": errors(rows)}
