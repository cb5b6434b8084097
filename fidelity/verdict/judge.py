"""The one judging sequence of `fidelity ab`, `fidelity kld` and `fidelity engines`:
per-prompt signals -> summary per (arm, signal, place) with bootstrap CIs -> each
signal's highest floor -> attribution of every signal to the factors -> the verdict,
which names every factor whose interval clears its signal's floor."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .binary import clears as exact_clears
from .binary import exact_tests, power_sentence
from .findings import mechanism_findings, mechanism_sentence, schedule_of
from .attribution import Bootstrap
from .signals import (FLOOR_EPS, SCHEDULE_FACTOR, SIGNALS, Design, attribute_signals,  # noqa: F401
                      floor_levels, kind, signal_summary, with_multiples)
from .spikes import SIGNAL as SPIKE_SIGNAL, SPIKE
from .tail import METHOD as TAIL
from .tail import clears as tail_clears
from .tail import tail_tests, tail_words


def judge(sig: pd.DataFrame, design: Design, boot: Bootstrap, n_prompts: int | None = None,
          direct: pd.DataFrame | None = None, describe: dict[str, str] | None = None) -> dict:
    """Summary, floors, attribution and verdict of the signals `sig` (signals.COLUMNS).
    `direct`: attribution rows measured directly between arms (signals.direct_effects),
    judged with the rest. `n_prompts` defaults to the prompts in `sig`. `describe`: prompt
    -> words for the verdict ("511 tokens, needle at 70%") where the tail names prompts."""
    summary = signal_summary(sig, boot.n_boot, boot.seed)
    floors = floor_levels(summary, design.floors, design.noise_for_mechanism())
    serving = floor_levels(summary, design.noise_for_mechanism(), design.noise_for_mechanism())
    attr = attribute_signals(sig[sig.arm.isin(list(design.arms))], design, boot)
    if direct is not None:
        attr = pd.concat([attr, direct], ignore_index=True)
    exact = exact_tests(sig, design.arms, design.noise_for_mechanism())
    tail = tail_tests(sig, design.arms, design.floors, describe, serving=design.noise_for_mechanism())
    v, table = verdict(attr, floors, sig.prompt.nunique() if n_prompts is None else n_prompts, exact,
                       serving, tail)
    return {"summary": summary, "floors": floors, "attribution": table, "verdict": v}


MIN_PROMPTS = 5          # below this a bootstrap over prompts says little (the verdict warns)


def verdict(attr: pd.DataFrame, floors: pd.DataFrame, n_prompts: int | None = None,
            exact: pd.DataFrame | None = None, serving: pd.DataFrame | None = None,
            tail: pd.DataFrame | None = None) -> tuple[dict, pd.DataFrame]:
    """Outcome: name every toggle whose interval, for some outcome signal and method, lies
    wholly above that signal's highest floor; the culprit is the one clearing by the
    largest factor. Mechanism: the same for mechanism signals against their own floors,
    plus the exact tests of binary signals (`exact`, binary.exact_tests), reported
    separately. With fewer than MIN_PROMPTS prompts the sentence says the bootstrap
    intervals are not to be trusted. `serving`: the floors of `under_schedule` effects
    (default `floors`), see _table. `tail`: the per-prompt tail tests (tail.tail_tests),
    which name a toggle that breaks a few prompts far beyond their floors."""
    t = _table(attr, floors, exact, serving, tail)
    mech = t[(t.kind == "mechanism") & t.clears]
    v = _outcome(t[t.kind == "outcome"], mechanism=not mech.empty, n=n_prompts)
    v["mechanism"] = mechanism_findings(mech, {n["toggle"] for n in v["named"]})
    v["mechanism_sentence"] = mechanism_sentence(v["mechanism"])
    v["outcome_sentence"] = v["sentence"]
    v["power_sentence"] = power_sentence(exact) if exact is not None and len(exact) else ""
    if v["mechanism"]:
        v["sentence"] += " " + v["mechanism_sentence"]
    if n_prompts is not None and n_prompts < MIN_PROMPTS:
        v["sentence"] += (f" Caution: only {n_prompts} prompt(s); the intervals are a bootstrap "
                          f"over prompts and mean little below {MIN_PROMPTS}.")
        v["few_prompts"] = True
    return v, t


def _table(attr: pd.DataFrame, floors: pd.DataFrame, exact: pd.DataFrame | None,
           serving: pd.DataFrame | None = None, tail: pd.DataFrame | None = None) -> pd.DataFrame:
    """Attribution rows with their floor, whether they clear it and by what factor; exact
    tests' rows (their floor: the comparator's own rate) judged by their p-value.

    An `under_schedule` effect (arm@S + t vs arm@S) compares two arms of the same
    numerics, one with a serving bug: what can legitimately separate them is reduction and
    tie order (an engine's kernels see other shapes under S) and the golden's own schedule
    floor -- the `serving` floors -- not the QAT floor, a property of the weights that is
    the same on both sides of a cache hit.

    A schedule is context, never a suspect: rows whose factor is a schedule (golden@S
    against golden) are left out; what golden does under S is floor:schedule@S."""
    t = attr.merge(floors, on=["signal", "where"], how="left")
    if serving is not None and len(t):
        sv = attr.merge(serving, on=["signal", "where"], how="left")
        use = (t.method == "under_schedule").to_numpy()
        t.loc[use, ["floor_hi", "floor_arm"]] = sv.loc[use, ["floor_hi", "floor_arm"]].to_numpy()
    t["floor_hi"] = t["floor_hi"].fillna(0.0)
    t["clears"] = (t.lo > t.floor_hi) & (t.value > 0)
    if "vs_oneshot_lo" in t and len(t):
        # an effect under S is the schedule's only when it exceeds the same toggle's one-shot
        # effect by more than the floor (paired); else the finding is the one-shot row's
        lo = pd.to_numeric(t.vs_oneshot_lo, errors="coerce")
        same = (t.method == "under_schedule") & lo.notna() & ~(lo.fillna(np.inf) > t.floor_hi)
        t["same_as_oneshot"] = same
        t.loc[same, "clears"] = False
    if exact is not None and len(exact):
        e = exact.assign(floor_hi=exact.c / exact.n.clip(lower=1), floor_arm=exact.vs)
        e["clears"] = exact_clears(e)
        t = pd.concat([t, e], ignore_index=True) if len(t) else e
    if tail is not None and len(tail):
        tail = tail.assign(clears=tail_clears(tail))
        t = pd.concat([t, tail], ignore_index=True) if len(t) else tail
    t = t[~t.toggle.astype(str).str.startswith(SCHEDULE_FACTOR)].reset_index(drop=True)
    t = with_multiples(t)
    t["kind"] = t.signal.map(kind)
    t["clears"] = t["clears"].astype(bool)
    return t


def _outcome(t: pd.DataFrame, mechanism: bool, n: int | None = None) -> dict:
    """The outcome verdict: every toggle with an outcome row clearing its floor, the
    strongest first. A toggle's lead row is its strongest mean-effect row; a toggle named
    only by the per-prompt tail leads with its tail ("breaks 2 of 18 prompts ...")."""
    if t.empty:
        return {"culprit": None, "named": [], "sentence": "No attribution was computed (need at "
                "least one toggle arm besides golden)."}
    hits = t[t.clears].sort_values("x_floor_lo", ascending=False)
    if hits.empty:
        return {"culprit": None, "named": [], "sentence": _nothing(t, mechanism)}
    lead = pd.concat([hits[hits.method != TAIL], hits[hits.method == TAIL]]).drop_duplicates("toggle")
    best = lead.sort_values("x_floor_lo", ascending=False)
    named = [{**_named(r, hits), "n": n} for _, r in best.iterrows()]
    c = named[0]
    others = ", ".join(f"{n['toggle']} ({_short(n)})" for n in named[1:])
    under = f" under {c['schedule']}" if c["schedule"] else ""
    sentence = (f"{c['toggle']} breaks coherence{under}: {_words(c)}; "
                f"outcome signals cleared: {', '.join(c['signals'])}."
                + (f" Also above their floors: {others}." if others else ""))
    return {"culprit": c["toggle"], "named": named, "method": c["method"], "schedule": c["schedule"],
            "signal": c["signal"], "where": c["where"], "value": c["value"], "lo": c["lo"],
            "hi": c["hi"], "sentence": sentence}


def _named(r, hits: pd.DataFrame) -> dict:
    mine = hits[hits.toggle == r.toggle]
    tail = mine[mine.method == TAIL]
    out = {"toggle": r.toggle, "signal": r.signal, "where": r["where"], "method": r.method,
           "schedule": schedule_of(r), "value": float(r.value), "lo": float(r.lo), "hi": float(r.hi),
           "floor_hi": float(r.floor_hi), "floor_arm": r.get("floor_arm"), "x_floor": float(r.x_floor),
           "x_floor_lo": float(r.x_floor_lo),
           "signals": sorted(set(mine.signal))}
    if len(tail):
        same = tail[tail.signal == r.signal]                # the lead's own signal when it breaks prompts
        tr = (same if len(same) else tail).iloc[0]
        out["tail"] = {k: tr[k] for k in ("signal", "b", "n", "value", "floor_hi", "p_value", "worst",
                                          "prompts")}
        out["tail"]["words"] = tail_words(tr)
    return out


def _words(n: dict) -> str:
    """How the named toggle clears: its mean effect with the interval, or its tail."""
    if n["method"] == TAIL:
        return f"it {n['tail']['words']}; broken prompts: {n['tail']['prompts']}"
    if n["signal"] == SPIKE_SIGNAL:
        return (f"{n['value']:.2%} of its positions have a KLD at least {SPIKE:g}x the floors' at that "
                f"position (95% CI [{n['lo']:.2%}, {n['hi']:.2%}]" + (f" over {n['n']} prompts" if n.get("n") else "")
                + f"), where the floors' own share reaches {n['floor_hi']:.2%} ({n.get('floor_arm')}): "
                "rare wrong tokens, which a mean over positions averages away")
    words = (f"its {n['method'].replace('_', '-')} effect on {n['signal']} ({SIGNALS[n['signal']]}) at "
             f"{n['where']} is {n['value']:.3g} (95% CI [{n['lo']:.3g}, {n['hi']:.3g}]"
             + (f" over {n['n']} prompts" if n.get("n") else "") + "), "
             + floor_words(n["floor_hi"], n.get("floor_arm")))
    if "tail" in n and n["tail"]["b"] < n["tail"]["n"]:
        words += f"; it {n['tail']['words']}"
    return words


def _short(n: dict) -> str:
    if n["method"] == TAIL:
        return f"{n['signal']}, {int(n['tail']['b'])} of {int(n['tail']['n'])} prompts, worst {n['tail']['worst']}"
    return f"{n['signal']}, {n['where']}" + (f", under {n['schedule']}" if n["schedule"] else "")


def _nothing(t: pd.DataFrame, mechanism: bool) -> str:
    k = t[(t.signal == "kld_mean") & (t.method != TAIL)].sort_values("value", ascending=False)
    top = k.iloc[0] if len(k) else t.sort_values("value", ascending=False).iloc[0]
    lead = "No toggle changes the outcome beyond its floors" if mechanism else "No toggle stands out"
    largest = (f"largest mean-KLD effect: {top.toggle}, {top.value:.3g} [{top.lo:.3g}, {top.hi:.3g}] vs "
               f"{floor_words(top.floor_hi, top.get('floor_arm'), 'floor')}")
    tails = t[(t.method == TAIL) & (t.b > 0)] if "b" in t else t.iloc[:0]
    if tails.empty:
        return (f"{lead}: for no outcome signal does a toggle's interval clear its floor, and no toggle "
                f"breaks a prompt beyond its floors ({largest}).")
    r = tails.sort_values(["b", "p_value"], ascending=[False, True]).iloc[0]
    return (f"{lead}: for no outcome signal does a toggle's interval clear its floor ({largest}). "
            f"Prompts broken (10x their floors) but too few to tell from noise: {r.toggle} {tail_words(r)}; "
            "more prompts at those lengths would decide.")


def floor_words(value: float, arm, lead: str = "above the highest floor's") -> str:
    """A floor in words; a comparison that had no floor arm says so instead of printing
    0 (nan)."""
    if arm is None or (isinstance(arm, float) and np.isnan(arm)):
        return "with no floor measured (no floor arm in this comparison)"
    return f"{lead} {value:.3g} ({arm})"


def golden_follows(manifest: dict) -> str:
    """The sentence that names the reference revision the run's golden follows (runs made
    before manifests recorded it: nothing)."""
    ref = manifest.get("reference")
    return f" The golden follows {ref}." if ref else ""
