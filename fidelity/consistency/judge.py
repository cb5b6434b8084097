"""Which serving condition changes the answer: every condition's comparisons against the
arm's own floor.

Per (arm, family, condition): probes, bit-identical replies, replies whose greedy tokens
part (and the earliest step), distinct completions, KL at the first generated token and
over the generated tokens, the engine's cached-token count.

Repeat families (prefix, batch: the floor is the same request asked again under the
reference condition) flag a condition when
  * the floor is exact (every floor pair bit-identical) and some reply under it is not --
    on such an engine anything else is a change of serving numerics; or
  * the floor is not exact and its replies part from the reference more often than the
    floor's (one-sided Fisher exact test, p < ALPHA), or its KL is above every floor
    pair's in more probes than chance allows (one-sided binomial, p < ALPHA).
Step families (chunk, longgen: KL against a reference computed here, along a sequence)
flag a stretch whose KL jumps above the stretch before it (`_jump`); an arm that differs
from the reference evenly is not flagged. Long generations' behaviour (loops, leaks ...)
is judged in `behaviour_table`.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import binomtest, fisher_exact, mannwhitneyu

ALPHA = 0.05
# per family: the reference condition (stored, not judged) and the floor condition
REFERENCE = {"prefix": "cold", "batch": "alone", "chunk": "profile", "longgen": "behaviour"}
FLOOR = {"prefix": "cold-again", "batch": "alone-again"}
JUMP = 4.0               # step families: a stretch's mean KL over the one before it, at least


def floor_of(family: str, condition: str) -> str:
    """The floor condition a condition is judged against (chunk: its own boundary's
    before-window; longgen: the start of the same run, greedy or sampled)."""
    if family == "chunk":
        return "before@" + condition.split("@", 1)[1]
    if family == "longgen":
        return condition.split(":", 1)[0] + ":start"
    return FLOOR[family]


def is_floor(family: str, condition: str) -> bool:
    return floor_of(family, condition) == condition


def is_reference(family: str, condition: str) -> bool:
    """Rows that are not comparisons: stored references, profiles, behaviour summaries."""
    return condition.split(":")[-1] == REFERENCE[family]


def condition_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (arm, family, condition) with its counts, statistics and flag."""
    rows = rows[[not is_reference(f, c) for f, c in zip(rows.family, rows.condition)]]
    out = []
    for (arm, fam), g in rows.groupby(["arm", "family"], sort=False):
        for cond, c in g.groupby("condition", sort=False):
            floor = g[g.condition == floor_of(fam, cond)]
            flag = (_floor_row() if is_floor(fam, cond) else _jump(c, floor, BEFORE[fam])
                    if fam in BEFORE else _flag(c, floor))
            out.append({"arm": arm, "family": fam, "condition": cond, **_stats(c), **flag})
    cols = ["arm", "family", "condition", "class", "shared", "probes", "bitwise", "diverged",
            "first_step", "distinct", "kl_first_median", "kl_first_max", "kl_max", "cached_median",
            "reruns", "flagged", "why"]
    return pd.DataFrame(out, columns=cols)


def _stats(c: pd.DataFrame) -> dict:
    steps = c.first_diff.dropna()
    cached = pd.to_numeric(c.cached, errors="coerce").dropna()
    distinct = c.groupby("probe").tokens.apply(
        lambda t: len({tuple(x) if isinstance(x, list) else () for x in t}))
    return {"class": c["class"].iloc[0], "shared": c["shared"].iloc[0], "probes": len(c),
            "bitwise": int(c.bitwise.sum()), "diverged": int(c.first_diff.notna().sum()),
            "first_step": int(steps.min()) if len(steps) else None,
            "distinct": int(distinct.max()),
            "kl_first_median": float(c.kl_first.median()), "kl_first_max": float(c.kl_first.max()),
            "kl_max": float(c.kl_max.max()),
            "cached_median": float(cached.median()) if len(cached) else None,
            "reruns": _reruns(c)}


def _reruns(rows: pd.DataFrame) -> int:
    """Times conditions were asked again because a reply came from the cache beyond them
    (prefix.py `_within`; 0 in other families and in probes stored before the check)."""
    return int(pd.to_numeric(rows["reruns"], errors="coerce").fillna(0).sum()) if "reruns" in rows else 0


def cache_reruns(rows: pd.DataFrame, arm: str) -> int:
    return _reruns(rows[rows.arm == arm]) if len(rows) else 0


def rerun_lines(rows: pd.DataFrame) -> list[str]:
    """Per arm: the replies that came back with more prompt tokens from the cache than their
    condition allows (cold: none; hit@P: P), discarded and asked again after a flush -- and
    those still over after every re-run, whose comparisons are not what they say."""
    if rows.empty or "reruns" not in rows:
        return []
    lines = []
    for arm, g in rows[pd.to_numeric(rows.reruns, errors="coerce").fillna(0) > 0].groupby("arm", sort=False):
        hit = g.condition.str.startswith("hit@")
        counts = sorted({int(x) for w in g.warm_cached for x in (w or [])})
        parts = [f"{n} {what} repl{'y' if n == 1 else 'ies'} {how}" for n, what, how in (
            (_reruns(g[~hit]), "cold", "came back with prompt tokens from the cache"),
            (_reruns(g[hit]), "hit", "took more prompt tokens from the cache than the prefix they share"))
            if n]
        still = g[g.still_warm.fillna(False).astype(bool)] if "still_warm" in g else g.iloc[:0]
        end = (f"; still so after every re-run: {', '.join(still.condition)} (not what they say: "
               "does the flush route empty the cache?)" if len(still) else "")
        lines.append(f"`{arm}` (prefix): {' and '.join(parts)} ({', '.join(map(str, counts))} cached: a "
                     "retried request the server had already processed, or a flush that did not empty "
                     f"the cache); each was discarded, the cache flushed and the condition re-run{end}.")
    return lines


def _floor_row() -> dict:
    return {"flagged": False, "why": "floor"}


# families judged as a step in KL against the stretch before it (a chunk boundary, a later
# part of a generation), and what that stretch is called in their sentences
BEFORE = {"chunk": "just before it", "longgen": "at the start of the generation"}


def _jump(c: pd.DataFrame, floor: pd.DataFrame, before_name: str) -> dict:
    """A stretch (after a chunk boundary, later in a generation) against the one before it,
    per-position KL pooled over probes: flagged when higher (one-sided Mann-Whitney,
    p < ALPHA) by at least JUMP times in the mean -- a step, not an even difference."""
    after = np.concatenate([np.asarray(x, float) for x in c.kl_window])
    before = np.concatenate([np.asarray(x, float) for x in floor.kl_window]) if len(floor) else np.zeros(0)
    if not len(before):
        return {"flagged": False, "why": "no floor"}
    if not after.any():
        return {"flagged": False, "why": "identical to the reference here"}
    p = mannwhitneyu(after, before, alternative="greater").pvalue
    ratio = after.mean() / before.mean() if before.mean() > 0 else np.inf
    step = (f"{ratio:.3g}x the KL {before_name}" if np.isfinite(ratio)
            else f"while the tokens {before_name} are identical to the reference")
    return {"flagged": bool(p < ALPHA and ratio >= JUMP),
            "why": f"{step} (Mann-Whitney p={p:.2g}; flagged at >= {JUMP:g}x and p < {ALPHA})"}


def _flag(c: pd.DataFrame, floor: pd.DataFrame) -> dict:
    if floor.empty:
        return {"flagged": False, "why": "no floor"}
    n, nf = len(c), len(floor)
    if floor.bitwise.all():
        k = int((~c.bitwise.astype(bool)).sum())
        return {"flagged": k > 0, "why": f"{k}/{n} not bit-identical; floor exact ({nf}/{nf})"}
    d, df = int(c.first_diff.notna().sum()), int(floor.first_diff.notna().sum())
    p_tok = fisher_exact([[d, n - d], [df, nf - df]], alternative="greater").pvalue
    above = int((c.kl_max > floor.kl_max.max()).sum())
    p_kl = binomtest(above, n, 1 / (nf + 1), alternative="greater").pvalue
    flagged = bool(min(p_tok, p_kl) < ALPHA)
    return {"flagged": flagged, "why": f"tokens part in {d}/{n} vs floor {df}/{nf} (p={p_tok:.2g}); "
                                       f"KL above every floor pair in {above}/{n} (p={p_kl:.2g})"}


# how a family's sentences name what a condition is compared with, and its floor
COMPARED = {"prefix": ("its cold replies", "cold vs cold"), "batch": ("its alone replies", "alone vs alone"),
            "chunk": ("the one-piece reference", "before the boundaries"),
            "longgen": ("the reference along its own output", "the first tokens")}


def verdict_lines(table: pd.DataFrame) -> list[str]:
    """One sentence per arm and family: the conditions under which its replies differ,
    strongest first, or that none does."""
    lines = []
    for (arm, fam), g in table.groupby(["arm", "family"], sort=False):
        floor = g[[is_floor(fam, c) for c in g.condition]]
        fl = ("bit-identical" if len(floor) and (floor.bitwise == floor.probes).all()
              else f"KL up to {floor.kl_max.max():.3g}" if len(floor) else "not measured")
        what, floor_name = COMPARED[fam]
        hits = g[g.flagged].sort_values("kl_max", ascending=False)
        n = len(g) - len(floor)
        if hits.empty:
            lines.append(f"`{arm}` ({fam}): no serving condition changes its replies "
                         f"({floor_name}: {fl}; {n} conditions).")
            continue
        parts = [_describe(r) for _, r in hits.head(3).iterrows()]
        more = f"; {len(hits) - 3} more in the table" if len(hits) > 3 else ""
        lines.append(f"`{arm}` ({fam}) differs from {what} under {len(hits)} of {n} conditions: "
                     + "; ".join(parts) + f"{more} ({floor_name}: {fl}).")
    return lines


def _describe(r) -> str:
    if r["class"] == "chunk-boundary":
        top1 = (f", top-1 differs from the reference in {r.diverged}/{r.probes} windows" if r.diverged
                else ", same top-1 throughout")
        return (f"the prefill chunk boundary at token {int(r.shared)}: KL up to {r.kl_max:.3g} just "
                f"after it, {r.why.split(' (')[0]}{top1}")
    if r["class"] == "generation":
        return (f"generated tokens from step {int(r.shared)}: KL up to {r.kl_max:.3g} against the "
                f"reference, {r.why.split(' (')[0]}")
    if r["class"] == "full":
        where = "a full-prompt hit"
    elif r["class"] == "multi-turn":
        where = "a second chat turn re-sending the first"
    elif r["class"] == "eviction":
        where = f"the prompt again after {int(r.shared)} tokens of other prompts (eviction pressure)"
    elif r["class"] == "concurrency":
        where = f"{int(r.shared)} other request(s) in flight ({r.distinct} distinct completions per probe)"
    else:
        where = f"a prefix hit sharing {int(r.shared)} tokens ({r['class']} boundary)"
    cached = "" if r.cached_median is None or np.isnan(r.cached_median) else \
        f", {int(r.cached_median)} tokens from the cache"
    tok = (f", greedy tokens part from step {int(r.first_step)} in {r.diverged}/{r.probes}"
           if r.diverged else ", same greedy tokens")
    return (f"{where}: KL up to {r.kl_max:.3g} over the generated tokens "
            f"({r.kl_first_max:.3g} at the first){tok}{cached}")


def behaviour_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Long generations per arm: length (and against the first arm's), how they ended, loops,
    thinking until the cap, special-token leaks, early EOS, where drift starts. Flagged:
    drift, or more loops / thinking-until-cap / leaks than the first arm (the baseline; with
    one arm, any)."""
    b = rows[rows.condition.str.endswith(":behaviour")] if len(rows) else rows
    if b.empty:
        return pd.DataFrame()
    out = []
    for (arm, mode), g in b.groupby(["arm", "mode"], sort=False):
        starts = g.drift_start.dropna()
        out.append({"arm": arm, "mode": mode, "generations": len(g), "mean_length": float(g.length.mean()),
                    "finish": ", ".join(f"{k} {v}" for k, v in g.finish.value_counts().items()),
                    "loops": int(g.loop.sum()), "thinking_until_cap": int(g.thinking_until_cap.sum()),
                    "leaks": int(g.leaks.map(bool).sum()), "early_eos": int(g.early_eos.sum()),
                    "drifting": len(starts), "drift_start_min": int(starts.min()) if len(starts) else None})
    t = pd.DataFrame(out)
    # lengths and misbehaviour counts against the first arm's (the baseline), mode by mode
    first = t.groupby("mode")
    t.insert(4, "length_vs_first_arm", t.mean_length / first.mean_length.transform("first"))
    cols = ["loops", "thinking_until_cap", "leaks"]
    base = first[cols].transform("first") if t.arm.nunique() > 1 else 0
    t["flagged"] = (t.drifting > 0) | (t[cols] > base).any(axis=1)
    return t


def behaviour_lines(t: pd.DataFrame) -> list[str]:
    lines = []
    for _, r in t.iterrows():
        n = r.generations
        bad = [f"{what} in {int(r[col])}/{n}" for col, what in
               (("loops", "loops"), ("thinking_until_cap", "thinking until the cap"),
                ("leaks", "special tokens in the text"), ("early_eos", "early EOS")) if r[col]]
        drift = (f"drift along its own output starts at step {int(r.drift_start_min)} in {r.drifting}/{n} "
                 "generations" if r.drifting else "no drift along its own output")
        lines.append(f"`{r.arm}` (long generation, {r['mode']}, {r.mean_length:.0f} tokens on average): {drift}"
                     + (f"; {', '.join(bad)}" if bad else "") + ".")
    return lines
