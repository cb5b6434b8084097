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
The chunk family (KL against a reference computed here, along a prompt) flags a window
whose KL jumps above the window before it (`_jump`); an arm that differs from the
reference evenly is not flagged. Long generations are judged once, per arm and run
(greedy, sampled), by `longgen_table`: a stretch of the output whose KL is above the
engine's own re-read of the same tokens (`_against_reread`), or a misbehaviour more
frequent than in the baseline arm's runs (Fisher exact); the verdict sentence, the
behaviour table and the exit code all read that one decision.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import binomtest, fisher_exact, mannwhitneyu, wilcoxon

from .longgen import ROLLING, drift_start

ALPHA = 0.05
# per family: the reference condition (stored, not judged) and the floor condition
REFERENCE = {"prefix": "cold", "batch": "alone", "chunk": "profile", "longgen": "behaviour"}
FLOOR = {"prefix": "cold-again", "batch": "alone-again"}
JUMP = 4.0               # chunk: a window's mean KL over the one before it; longgen: over its re-read


def floor_of(family: str, condition: str) -> str:
    """The floor condition a condition is judged against (chunk: its own boundary's
    before-window; longgen: the engine's re-read of the same run, greedy or sampled)."""
    if family == "chunk":
        return "before@" + condition.split("@", 1)[1]
    if family == "longgen":
        return condition.split(":", 1)[0] + ":floor"
    return FLOOR[family]


def is_floor(family: str, condition: str) -> bool:
    return floor_of(family, condition) == condition


def is_reference(family: str, condition: str) -> bool:
    """Rows that are not comparisons: stored references, profiles, behaviour summaries."""
    return condition.split(":")[-1] == REFERENCE[family]


def condition_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (arm, family, condition) with its counts, statistics and flag."""
    rows = rows[pd.Series([not is_reference(f, c) for f, c in zip(rows.family, rows.condition)],
                          index=rows.index, dtype=bool)]        # (a list would select columns when empty)
    out = []
    for (arm, fam), g in rows.groupby(["arm", "family"], sort=False):
        for cond, c in g.groupby("condition", sort=False):
            floor = g[g.condition == floor_of(fam, cond)]
            flag = (_floor_row() if is_floor(fam, cond) else _against_reread(c) if fam == "longgen"
                    else _jump(c, floor, BEFORE[fam]) if fam in BEFORE else _flag(c, floor))
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


# families judged as a step in KL against the window before it (a chunk boundary), and what
# that window is called in their sentences
BEFORE = {"chunk": "just before it"}


def _jump(c: pd.DataFrame, floor: pd.DataFrame, before_name: str) -> dict:
    """A window (after a chunk boundary) against the one before it,
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
    # the means the flag compares, both quoted: a window's max can sit below the one before
    # it while its mean is 4x higher, and a line quoting the two maxima reads as a contradiction
    step = (f"mean KL {after.mean():.3g} just after it vs {before.mean():.3g} {before_name}, {ratio:.3g}x"
            if np.isfinite(ratio) else
            f"mean KL {after.mean():.3g} just after it while the tokens {before_name} are identical "
            "to the reference")
    return {"flagged": bool(p < ALPHA and ratio >= JUMP),
            "why": f"{step} (Mann-Whitney p={p:.2g}; flagged at >= {JUMP:g}x and p < {ALPHA})"}


def _against_reread(c: pd.DataFrame) -> dict:
    """A stretch of a long generation against the engine's own re-read of the same tokens
    (one prefill: none of the state the decode built), position by position, pooled over
    probes: flagged when the generation's KL is higher (one-sided Wilcoxon signed-rank on
    the paired differences, p < ALPHA) by at least JUMP times in the mean. The floor is
    measured at the very positions judged, so an onset at any step is seen; a kernel as
    far from the reference re-read as generated is not flagged."""
    gen = np.concatenate([np.asarray(x, float) for x in c.kl_window])
    floor = np.concatenate([np.asarray(x, float) for x in c.floor_window])
    d = gen - floor
    if not d.any():
        return {"flagged": False, "why": "as its re-read" if gen.any() else "identical to the reference here"}
    p = float(wilcoxon(d[d != 0], alternative="greater").pvalue)
    ratio = gen.mean() / floor.mean() if floor.mean() > 0 else np.inf
    step = (f"{ratio:.3g}x the KL of its re-read of the same tokens" if np.isfinite(ratio)
            else "while its re-read of the same tokens is identical to the reference")
    return {"flagged": bool(p < ALPHA and ratio >= JUMP),
            "why": f"{step} (Wilcoxon p={p:.2g}; flagged at >= {JUMP:g}x and p < {ALPHA})"}


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
            "chunk": ("the one-piece reference", "before the first boundary")}


def verdict_lines(table: pd.DataFrame) -> list[str]:
    """One sentence per arm and family: the conditions under which its replies differ,
    strongest first, or that none does. Long generations are said by `longgen_lines`
    (their one judgement), not here."""
    lines = []
    for (arm, fam), g in table.groupby(["arm", "family"], sort=False):
        if fam == "longgen":
            continue
        floor = g[[is_floor(fam, c) for c in g.condition]]
        n = len(g) - len(floor)
        if fam == "chunk" and len(floor):
            # quoted: the positions before the first boundary, the only ones no chunk boundary
            # can have touched (a later boundary's before-window already follows one)
            first = min(floor.condition, key=lambda c: int(c.split("@", 1)[1]))
            floor = floor[floor.condition == first]
        fl = ("bit-identical" if len(floor) and (floor.bitwise == floor.probes).all()
              else f"KL up to {floor.kl_max.max():.3g}" if len(floor) else "not measured")
        what, floor_name = COMPARED[fam]
        hits = g[g.flagged].sort_values("kl_max", ascending=False)
        if hits.empty:
            lines.append(f"`{arm}` ({fam}): no serving condition changes its replies "
                         f"({floor_name}: {fl}; {n} condition{'s' if n != 1 else ''} compared).")
            continue
        parts = [_describe(r) for _, r in hits.head(3).iterrows()]
        more = f"; {len(hits) - 3} more in the table" if len(hits) > 3 else ""
        # replies that differ only below the greedy choice: the serving numerics move, the
        # answers do not -- said as such, so a 1e-11 wobble does not read like a broken answer
        how = ("its numerics change (not its greedy answers)" if not hits.diverged.any()
               else f"differs from {what}")
        # chunk: each boundary is judged against the window just before it, quoted in its
        # part; the largest KL before any boundary is not what it was compared with
        floor_words = ("each boundary against the positions just before it" if fam in BEFORE
                       else f"{floor_name}: {fl}")
        lines.append(f"`{arm}` ({fam}) {how} under {len(hits)} of {n} conditions: "
                     + "; ".join(parts) + f"{more} ({floor_words}).")
    return lines


def _describe(r) -> str:
    if r["class"] == "chunk-boundary":
        top1 = (f", top-1 differs from the reference in {r.diverged}/{r.probes} windows" if r.diverged
                else ", same top-1 throughout")
        return f"the prefill chunk boundary at token {int(r.shared)}: {r.why.split(' (')[0]}{top1}"
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


# misbehaviour counted per long generation: (the table's count, the behaviour row's field, words)
BEHAVIOUR = (("loops", "loop", "loops"), ("thinking_until_cap", "thinking_until_cap", "thinking until the cap"),
             ("leaks", "leaks", "special tokens in the text"), ("early_eos", "early_eos", "early EOS"))


def longgen_table(rows: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """The one judgement of long generations, per arm and run (greedy, sampled): flagged
    when some stretch of its output leaves the reference more than the engine's re-read of
    the same tokens (the conditions table's `mode:steps@a` rows), or a misbehaviour is more
    frequent than in the baseline arm's (the first arm's) same runs (`_behaviour_tests`).
    The behaviour table, the verdict sentence and the exit code all read its `flagged`."""
    b = rows[rows.condition.str.endswith(":behaviour")] if len(rows) else rows
    if b.empty:
        return pd.DataFrame()
    lg = table[table.family == "longgen"]
    out = [{"arm": arm, "mode": mode, **_counts(g),
            **_drift(g, lg[(lg.arm == arm) & lg.condition.str.startswith(mode + ":steps@")])}
           for (arm, mode), g in b.groupby(["arm", "mode"], sort=False)]
    t = pd.DataFrame(out)
    first = t.groupby("mode")
    t.insert(4, "length_vs_first_arm", t.mean_length / first.mean_length.transform("first"))
    tests = [_behaviour_tests(r, t[t["mode"] == r["mode"]]) for _, r in t.iterrows()]
    t["baseline"] = [x["baseline"] for x in tests]
    t["behaviour_p"] = [x["p"] for x in tests]
    t["flagged"] = [bool(r.stretches_flagged) or x["flagged"] for (_, r), x in zip(t.iterrows(), tests)]
    t["why"] = [_longgen_why(r, x) for (_, r), x in zip(t.iterrows(), tests)]
    return t


def _counts(g: pd.DataFrame) -> dict:
    """One run's generations: how many, how long, how they ended, each misbehaviour count."""
    return {"generations": len(g), "mean_length": float(g.length.mean()),
            "finish": ", ".join(f"{k} {v}" for k, v in g.finish.value_counts().items()),
            **{col: int(g[field].map(bool).sum()) for col, field, _ in BEHAVIOUR}}


def _drift(g: pd.DataFrame, stretches: pd.DataFrame) -> dict:
    """The run's stretches flagged against the re-read, the first of them, and -- only
    when some is -- where drift starts in each generation (`drift_start`)."""
    hit = stretches[stretches.flagged]
    starts = [s for kl, fl in zip(g.kl, g.kl_floor)
              if (s := drift_start(kl, fl, ROLLING, JUMP)) is not None] if len(hit) else []
    return {"stretches": len(stretches), "stretches_flagged": len(hit),
            "first_flagged": int(hit.shared.min()) if len(hit) else None,
            "drifting": len(starts), "drift_start_min": min(starts) if starts else None,
            "kl_max": max((max(k) for k in g.kl if len(k)), default=0.0),
            "floor_kl_max": max((max(k) for k in g.kl_floor if len(k)), default=0.0)}


def _behaviour_tests(r, runs: pd.DataFrame) -> dict:
    """Each misbehaviour count of a run against the baseline arm's (the first of `runs`,
    every arm's same run): one-sided Fisher exact test, p < ALPHA flags it. A count is not
    a rate: 2 of 2 against 1 of 2 is p = 0.5. The baseline itself is counted, not judged
    (with no other arm there is nothing to judge it against)."""
    base = runs.iloc[0]
    if r.arm == base.arm:
        return {"baseline": None, "p": None, "flagged": False, "found": [], "alone": len(runs) == 1}
    n, nb = int(r.generations), int(base.generations)
    found = []
    for col, _, what in BEHAVIOUR:
        k, kb = int(r[col]), int(base[col])
        if k:
            p = float(fisher_exact([[k, n - k], [kb, nb - kb]], alternative="greater").pvalue)
            found.append((what, k, n, kb, nb, p))
    p = min((f[-1] for f in found), default=None)
    return {"baseline": base.arm, "p": p, "flagged": p is not None and p < ALPHA, "found": found, "alone": False}


def _longgen_why(r, tests: dict) -> str:
    """The decision in words, for the table and (with the arm and run) the verdict."""
    n = int(r.generations)
    if r.stretches_flagged:
        start = (f"from step {int(r.drift_start_min)} (dated in {r.drifting}/{n} generations)" if r.drifting
                 else f"from the stretch at step {int(r.first_flagged)}")
        if r.drifting and r.drift_start_min <= 1:      # step 0 is the prefill's; step 1 the first decode
            start += ", its first decoded token: a decode path unlike its own prefill, or a bug from the start"
        parts = [f"leaves the reference {start} where its re-read of the same tokens does not: "
                 f"{r.stretches_flagged} of {r.stretches} stretches flagged, KL up to {r.kl_max:.3g} "
                 f"generating vs {r.floor_kl_max:.3g} re-read"]
    elif not (r.kl_max or r.floor_kl_max):
        parts = ["identical to the reference along its output, generated and re-read"]
    else:
        parts = [f"no stretch leaves the reference more than its re-read of the same tokens (KL up to "
                 f"{r.kl_max:.3g} generating vs {r.floor_kl_max:.3g} re-read)"]
    if tests["baseline"] is not None:
        parts += [f"{what} in {k}/{m} vs {kb}/{mb} for `{tests['baseline']}` (Fisher p={p:.2g})"
                  for what, k, m, kb, mb, p in tests["found"]]
    else:
        counted = [f"{what} in {int(r[col])}/{n}" for col, _, what in BEHAVIOUR if r[col]]
        if counted:
            whose = "no other arm to test against" if tests["alone"] else "the baseline of the other arms"
            parts.append(", ".join(counted) + f" ({whose}: counted, not judged)")
    return "; ".join(parts)


def longgen_lines(t: pd.DataFrame) -> list[str]:
    """One sentence per arm and run, from `longgen_table`'s decision (no other rule)."""
    return [f"`{r.arm}` (long generation, {r['mode']}, {r.mean_length:.0f} tokens on average) "
            + ("is flagged: " if r.flagged else "is not flagged: ") + r.why + "."
            for _, r in t.iterrows()]
