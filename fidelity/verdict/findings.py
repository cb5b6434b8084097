"""Mechanism findings in words: what a toggle changes inside the model (indexer selection,
the needle's entry, expert routing), where, by how much against the floor that is noise
for it -- and whether the outcome moved too ("outcome within floors at these lengths"
when it did not)."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..design.lengths import fits, period_reading, separating_lengths
from .signals import MECHANISM, MECHANISM_WHAT, SCHEDULE_FACTOR


def mechanism_findings(hits: pd.DataFrame, outcome_named: set[str]) -> list[dict]:
    """Per toggle with a mechanism signal clearing its floor: one entry per signal, its
    places and its strongest row. Order: strongest first (rows arrive unsorted)."""
    out = []
    hits = hits.sort_values("x_floor_lo", ascending=False)
    for toggle, grp in hits.groupby("toggle", sort=False):
        signals = []
        for signal in MECHANISM:
            g = grp[grp.signal == signal]
            if g.empty:
                continue
            r = g.iloc[0]
            signals.append({"signal": signal, "places": _places(g["where"]), "method": r.method,
                            "where": r["where"], "value": float(r.value), "lo": float(r.lo),
                            "hi": float(r.hi), "floor_hi": float(r.floor_hi),
                            "floor_arm": r.get("floor_arm"), "schedule": schedule_of(r), **_exact(r)})
        out.append({"toggle": toggle, "signals": signals, "outcome_named": toggle in outcome_named})
    return out


def schedule_of(row) -> str:
    """The schedule an under_schedule effect was measured under ('' for other methods)."""
    s = row.get("schedule")
    return s if isinstance(s, str) else ""


def _exact(r) -> dict:
    if "p_value" not in r or pd.isna(r.get("p_value")):
        return {}
    return {"b": int(r.b), "c": int(r.c), "n": int(r.n), "p_value": float(r.p_value), "vs": r.vs}


def _places(wheres: pd.Series) -> list[str]:
    """Distinct places, per-layer ones as layer numbers; a length group's copy of a place
    already listed is dropped."""
    seen = list(dict.fromkeys(wheres))
    base = {w for w in seen if " @ " not in w}
    return [w for w in seen if " @ " not in w or w.split(" @ ")[0] not in base]


def _layers(places: list[str]) -> str:
    nums = sorted((m.group(1) for p in places if (m := re.fullmatch(r"layer (\d+)", p))), key=int)
    rest = [p for p in places if not re.fullmatch(r"layer \d+", p)]
    words = []
    if nums:
        words.append(("layer " if len(nums) == 1 else "layers ")
                     + (nums[0] if len(nums) == 1 else ", ".join(nums[:-1]) + " and " + nums[-1]))
    return ", ".join(words + rest)


def _how_much(s: dict) -> str:
    if "p_value" in s:
        vs = "the floor" if s["method"] == "exact_vs_floors" else s["vs"]
        return (f"lost in {s['b']} of {s['n']} trials where {vs} ({s['floor_arm']}) keeps it, "
                f"{s['c']} the other way, exact p = {s['p_value']:.2g}")
    v, f, how = s["value"], s["floor_hi"], s["method"].replace("_", "-")
    if s["signal"] == "topk_loss" and s["method"] == "one_at_a_time":
        return f"top-k recall {1 - v:.3f} vs floor {1 - f:.3f}"
    if s["signal"] == "expert_disagree":
        return f"expert sets differ on {v:.1%} more tokens ({how}) vs floor {f:.1%}"
    return f"{s['signal']} {how} effect {v:.3g} [{s['lo']:.3g}, {s['hi']:.3g}] vs floor {f:.3g}"


SENTENCE_TOGGLES = 3     # the verdict names the strongest few; the table has every one


def mechanism_sentence(findings: list[dict]) -> str:
    """"Mechanism: t changes indexer selection at layers 1 and 3 (top-k recall 0.900 vs
    floor 0.985); outcome within floors at these lengths." -- one clause per toggle."""
    if not findings:
        return ""
    clauses = []
    for f in findings[:SENTENCE_TOGGLES]:
        parts = [f"{MECHANISM_WHAT[s['signal']]} at {_layers(s['places'])}"
                 + (f" under {s['schedule']}" if s.get("schedule") else "") + f" ({_how_much(s)})"
                 for s in f["signals"]]
        tail = "" if f["outcome_named"] else "; outcome within floors at these lengths"
        clauses.append(f"{f['toggle']} changes " + "; ".join(parts) + tail)
    more = len(findings) - SENTENCE_TOGGLES
    tail = (f" {more} more toggle(s) change the mechanism less (the Mechanism table lists them)."
            if more > 0 else "")
    return "Mechanism: " + ". ".join(clauses) + "." + tail


def findings_table(findings: list[dict]) -> pd.DataFrame:
    """One row per (toggle, mechanism signal) for the reports."""
    rows = [{"toggle": f["toggle"], "changes": MECHANISM_WHAT[s["signal"]], "where": _layers(s["places"]),
             "how much": _how_much(s), "method": s["method"], "under": s.get("schedule", ""),
             "floor": s.get("floor_arm"),
             "outcome beyond floors": f["outcome_named"]}
            for f in findings for s in f["signals"]]
    return pd.DataFrame(rows, columns=["toggle", "changes", "where", "how much", "method", "under", "floor",
                                       "outcome beyond floors"])


# a first departure this many times its floor is stated in the verdict even when the
# outcome stays inside its floors (a kernel that is wrong at layer 0 by 20x is a finding)
DEPARTURE_X = 10.0
NEAR_X = 3.0            # below DEPARTURE_X but said: a steady 9x is no more noise than 10x
STEADY_P = 0.05         # the per-prompt sign test's bar for "steady"
STEADY_MIN_N = 5        # fewer prompts: a sign test cannot reach STEADY_P (1/32 at 5)
CERTAIN_P = 1e-4        # below the bar but above its floor on every prompt at this p: a finding
                        # of its own class ("small, certain"); needs >= 14 prompts (2^-14 < 1e-4)


def near_enough(mean_ratio: float, steady: dict | None) -> bool:
    """Say a below-the-bar departure? Its mean multiple or its per-prompt median at least
    NEAR_X, and steady: above the floor on more prompts than chance (sign test p < STEADY_P),
    or, with fewer than STEADY_MIN_N prompts (no test can tell), on every one."""
    if steady is None:
        return mean_ratio >= NEAR_X
    big = max(mean_ratio, steady["median"] if np.isfinite(steady["median"]) else 0.0) >= NEAR_X
    if steady["n"] < STEADY_MIN_N:
        return big and steady["above"] == steady["n"]
    return big and steady["p"] < STEADY_P


def certain(d: dict) -> bool:
    """A below-the-bar departure that is no accident: above its floor on every prompt, with a
    sign test at CERTAIN_P (a null or a re-association never gets there: its multiple stays
    under NEAR_X, or some prompts fall below the floor)."""
    st = d.get("steady")
    return bool(d.get("below_bar") and st and st["n"] >= STEADY_MIN_N and st["above"] == st["n"]
                and st["p"] < CERTAIN_P)


def certain_sentence(deps: list[dict]) -> str:
    """The small-and-certain departures in words: Small but certain: t departs 9.31x the
    reduction-order floor at layer 0 `attn.out` (prefill) on 36/36 prompts (..., sign test
    p = 1.5e-11); below the 10x bar, the outcome within floors."""
    if not deps:
        return ""
    return "Small but certain: " + "; ".join(
        f"{d['arm']} departs {d['ratio']:.3g}x the reduction-order floor at layer {d['layer']} `{d['tap']}` "
        f"({d['phase']}) on {d['steady']['above']}/{d['steady']['n']} prompts (per prompt "
        f"{d['steady']['lo']:.3g}-{d['steady']['hi']:.3g}x; sign test p = {d['steady']['p']:.2g})"
        for d in sorted(deps, key=lambda d: -d["ratio"])[:SENTENCE_TOGGLES]) + \
        f"; below the {DEPARTURE_X:g}x bar, the outcome within floors."


def steady_words(st: dict | None) -> str:
    """'; above the floor on 18/18 prompts (per prompt 8.4-9.9x; sign test p = 3.8e-06)'."""
    if not st:
        return ""
    rng = f"per prompt {st['lo']:.3g}-{st['hi']:.3g}x; " if np.isfinite(st["lo"]) else ""
    test = (f"sign test p = {st['p']:.2g}" if st["n"] >= STEADY_MIN_N
            else f"{st['n']} prompt{'s' if st['n'] != 1 else ''}: too few for a sign test")
    return f"; above the floor on {st['above']}/{st['n']} prompts ({rng}{test})"


def departure_sentence(deps: list[dict], named: set[str]) -> str:
    """"Departures: t first departs from golden at layer 0 `attn.q` (prefill) at 23.6x the
    reduction-order floor (0.4x the QAT floor); outcome within floors." -- the one-toggle
    arms whose outcome is not already named, strongest first; `deps`: first_divergence rows
    at DEPARTURE_X with `toggle` (None for an arm of several) and an optional `qat_ratio`."""
    # one-toggle arms only: an arm holding several toggles departs where one of them does
    # (`engine-t` at kv_fp8_from_fp32's place), which its own arm already says
    near = near_sentence([d for d in deps if d.get("below_bar") and d.get("toggle") not in named
                          and not certain(d)])
    quiet = sorted((d for d in deps if d.get("toggle") and d["toggle"] not in named and not d.get("below_bar")),
                   key=lambda d: -d["ratio"])
    if not quiet:
        return near
    clauses = []
    for d in quiet[:SENTENCE_TOGGLES]:
        x = "an infinite multiple of" if d["ratio"] == float("inf") else f"{d['ratio']:.3g}x"
        qat = f" ({d['qat_ratio']:.2g}x the QAT floor)" if d.get("qat_ratio") is not None else ""
        clauses.append(f"{d['arm']} first departs from {d['vs']} at layer {d['layer']} `{d['tap']}` "
                       f"({d['phase']}) at {x} the reduction-order floor{qat}")
    more = len(quiet) - SENTENCE_TOGGLES
    tail = f" {more} more arm(s) depart that far (the First divergence table lists them)." if more > 0 else ""
    return " ".join(filter(None, ["Departures (at least " + f"{DEPARTURE_X:g}x the floor; outcome within floors): "
                                  + "; ".join(clauses) + "." + tail, near]))


def near_sentence(near: list[dict]) -> str:
    """"Below the 10x bar: t departs at most 9.1x the reduction-order floor (layer 2 `attn.out`,
    prefill, ...)." -- one-toggle arms whose largest departure is below DEPARTURE_X and
    steady across prompts (near_enough), with the per-prompt evidence (steady_words)."""
    if not near:
        return ""
    near = sorted(near, key=lambda d: -d["ratio"])[:SENTENCE_TOGGLES]
    return (f"Below the {DEPARTURE_X:g}x bar: " + "; ".join(
        f"{d['arm']} departs at most {d['ratio']:.3g}x the reduction-order floor (layer {d['layer']} "
        f"`{d['tap']}`, {d['phase']}, mean over prompts{steady_words(d.get('steady'))})" for d in near) + ".")


def with_departures(v: dict, deps: list[dict]) -> dict:
    """The verdict with its departure findings in words (v["departures"], and the sentence)."""
    named = {n["toggle"] for n in v.get("named", [])}
    v["departures"] = deps
    v["small_certain"] = [d for d in deps if certain(d) and d.get("toggle") not in named]
    v["departure_sentence"] = " ".join(filter(None, [certain_sentence(v["small_certain"]),
                                                     departure_sentence(deps, named)]))
    if v["departure_sentence"]:
        v["sentence"] += " " + v["departure_sentence"]
    return v


def _alone(sets: dict[str, frozenset]) -> dict[str, list[str]]:
    """toggle -> its one-toggle arms, under any schedule."""
    alone: dict[str, list[str]] = {}
    for arm, s in sets.items():
        own = {f for f in s if not f.startswith(SCHEDULE_FACTOR)}
        if len(own) == 1:
            alone.setdefault(next(iter(own)), []).append(arm)
    return alone


def acted_only_at(kld: pd.DataFrame, sets: dict[str, frozenset]) -> dict[str, list[int]]:
    """toggle -> the prompt lengths where its one-toggle arms moved the final logits at all,
    for the toggles that were bit-identical to the golden at every other length of the run
    (a bug conditional on length: acting at one length only is the loudest clue there is
    to its condition, and a mean over the grid dilutes it). Needs a `length` column."""
    if not len(kld) or "length" not in kld:
        return {}
    out = {}
    for t, arms in _alone(sets).items():
        rows = kld[kld.arm.isin(arms)]
        if not len(rows):
            continue
        moved = sorted(int(L) for L, g in rows.groupby("length") if bool((g.kld != 0).any()))
        if moved and len(moved) < rows.length.nunique():
            out[t] = moved
    return out


def acted_only_sentence(acted: dict[str, list[int]], lengths: list[int], b=None) -> str:
    """`b` (fidelity.design.lengths.Boundaries, optional): per toggle, the config's period its
    lengths read as (lengths.period_reading) or, when this run cannot say, the lengths that
    would (`separating_to_run`)."""
    if not acted:
        return ""
    parts = []
    for t, L in acted.items():
        part = f"{t} only at length{'s' if len(L) > 1 else ''} {', '.join(map(str, L))}"
        if b is not None:
            reading, more = period_reading(L, lengths, b), separating_to_run(L, lengths, b)
            part += (f" ({reading})" if reading else "") + (
                f"; to tell the config's periods apart, run it at --lengths {','.join(map(str, more))}"
                if more else "")
        parts.append(part)
    return (f"Acted at some lengths only: {'; '.join(parts)} -- bit-identical to the golden at every other "
            f"length of this run ({', '.join(map(str, lengths))}): a condition on the length "
            "(docs/lengths.md: which lengths separate the config's periods).")


def separating_to_run(acted: list[int], lengths: list[int], b) -> list[int]:
    """The lengths that separate the config's periods for these acting lengths
    (lengths.separating_lengths), [] when exactly one period fits this run or it holds them all."""
    if len(fits(acted, lengths, b)) == 1:
        return []
    want = separating_lengths(acted, b)
    return want if set(want) - set(lengths) else []


def never_acted(kld: pd.DataFrame, sets: dict[str, frozenset]) -> list[str]:
    """The toggles whose own one-toggle arms (under every schedule run) gave the golden's final
    logits bit for bit at every position of every prompt (kld rows of `arm`, `kld`): these
    prompts never made them act, so they are untested here, not clean (a length- or schedule-conditional bug looks
    exactly like this on a grid that misses its condition)."""
    out = []
    for t, arms in _alone(sets).items():
        rows = kld[kld.arm.isin(arms)] if len(kld) else kld
        if len(rows) and set(rows.arm) == set(arms) and bool((rows.kld == 0).all()):
            out.append(t)
    return sorted(out)


def never_acted_sentence(names: list[str]) -> str:
    if not names:
        return ""
    return (f"Never acted: {', '.join(names)} gave the golden's final logits bit for bit on every prompt and "
            "position, so these lengths and schedules did not test "
            f"{'it' if len(names) == 1 else 'them'} (untested, not clean): try --lengths boundaries "
            "(the config's own periods) or a schedule such as @chunked(64).")


def with_never_acted(v: dict, names: list[str], acted: dict[str, list[int]] | None = None,
                     lengths: list[int] = (), b=None) -> dict:
    """The verdict with the toggles that never acted (v["never_acted"], and the sentence)
    and those that acted at some lengths only (v["acted_only_at"], acted_only_at), with the
    lengths that would tell the config's periods apart for each (v["separating_lengths"]:
    {toggle: lengths}, when `b` is given and this run does not settle it)."""
    v["never_acted"] = names
    v["acted_only_at"] = acted or {}
    more = {t: separating_to_run(L, list(lengths), b) for t, L in (acted or {}).items()} if b is not None else {}
    v["separating_lengths"] = {t: L for t, L in more.items() if L}
    v["never_acted_sentence"] = " ".join(filter(None, [never_acted_sentence(names),
                                                      acted_only_sentence(acted or {}, list(lengths), b)]))
    if v["never_acted_sentence"]:
        v["sentence"] += " " + v["never_acted_sentence"]
    return v


def verdict_lines(v: dict) -> list[str]:
    """The verdict as a report's first lines: outcome, then mechanism, departures, the
    toggles that never acted and what the selection tests could see (when there are any)."""
    lines = [v.get("outcome_sentence", v["sentence"])]
    if v.get("mechanism"):
        lines.append(v["mechanism_sentence"])
    return lines + [s for s in (v.get("departure_sentence"), v.get("never_acted_sentence"),
                                v.get("power_sentence")) if s]
