"""The `fidelity consistency` report, in the house format: one headline sentence (which
arm changes its replies under which condition, how much against its floor; the verdict's
full wording folded under it), the prefix-cache plot, Suspects (one row per flagged
condition or long-generation run, strongest first) and the commands worth running next;
then one section per probe family with its table (flagged rows first, folded when long)
and plot, every probe as a tidy CSV, and how the run was made (cold starts, sizes the
servers report, requests, retries)."""
from __future__ import annotations

import shlex

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from .judge import BEFORE, floor_of
from .plots import FIGURES, KL_FLOOR_PLOT, floors_mask

def _flagged_first(df: pd.DataFrame) -> pd.DataFrame:
    """Flagged rows first (their order kept), `flagged` and `why` beside the names so the
    explanation is on screen however wide the numbers run."""
    if df is None or df.empty or "flagged" not in df:
        return df
    df = df.iloc[np.argsort(~df.flagged.to_numpy(bool), kind="stable")]
    front = [c for c in ["arm", "mode", "condition", "flagged", "why"] if c in df]
    return df[front + [c for c in df.columns if c not in front]].reset_index(drop=True)


def _family_table(table: pd.DataFrame, family: str, drop: list[str]) -> Table:
    """One family's conditions: flagged first, folded past FOLD_ROWS with how many are
    flagged on the fold."""
    t = _flagged_first(table[table.family == family].drop(columns=["family", *drop]))
    k = int(t.flagged.sum())
    return Table(t, summary=f"{len(t)} conditions ({k} flagged, listed first)")


CAPTIONS = {"spec_kl": "Each probe's greedy reply with speculation against the baseline's, step by step "
                       "(log KL; the dashed line is the baseline asked again): circles mark the first step "
                       "whose distribution differs, triangles the first whose token differs, red crosses "
                       "tokens that are not the top-1 of their own step (only a wrong acceptance emits "
                       "them), stars special tokens injected.",
            "prefix_kl": "Every prefix-cache condition of every arm at its own coordinates: left, a "
                         "hit sharing P tokens at P (vertical lines: the boundary classes); right, the "
                         "conditions with no prefix length (a full hit, a second chat turn, the prompt "
                         "after eviction), each at its own place. Filled: flagged. Bit-identical replies "
                         f"are drawn at {KL_FLOOR_PLOT:g}; an arm whose curve hides under another's says "
                         "so in the legend (= the same numbers, ≈ within 1% of the axis)."}


# the spec family's per-probe lists (samples, tokens, the engine's counts): in probes.csv only
SPEC_LISTS = ["samples", "base_samples", "base_tokens", "seeds", "spec_meta", "base_meta", "injected",
              "top1", "base_top1", "injected_tokens", "off_top1", "off_top1_special", "base_off_top1", "served"]


def _sections(table: pd.DataFrame, behaviour: pd.DataFrame) -> list[Section]:
    out = []
    if (table.family == "prefix").any():
        out.append(Section(
            "Prefix cache: a hit vs the same prompt cold",
            "Each condition asks a probe prompt after the cache was warmed by another prompt "
            "sharing its first `shared` tokens (`hit@P`), or by the prompt itself (`full-hit`); "
            "the reply is compared with the prompt asked cold. `cold-again` is the floor: cold "
            "asked twice. `cached_median` is the engine's own count of prompt tokens taken from "
            "its cache (the proof a hit happened; a page-granular cache restores the largest page "
            "multiple below the shared prefix). `why` says the rule that flagged it "
            "(fidelity/consistency/judge.py).",
            [_family_table(table, "prefix", ["distinct"])]))
    if (table.family == "batch").any():
        out.append(Section(
            "Batch: alone vs with other requests in flight",
            "Each probe prompt is scored (prompt logprobs and a greedy continuation) alone, "
            "alone again (the floor), and `repeats` times while `shared` filler requests of mixed "
            "lengths are generating beside it (`batch@k`). `distinct`: distinct greedy "
            "completions among a probe's repeats. Prompt-logprob requests skip the engines' "
            "prefix caches, so repeats are not cache hits.",
            [_family_table(table, "batch", ["cached_median"])],
            ["batch_kl"]))
    if (table.family == "chunk").any():
        out.append(Section(
            "Chunked prefill: KL jumps at the chunk boundary",
            "Each probe prompt (straddling the engine's prefill chunk) is scored by the endpoint "
            "and by the reference in one piece; `before` is the window of positions just before "
            "the first boundary (the floor), `after@b` the window just after boundary b. "
            "`diverged`: windows where the top-1 token differs from the reference somewhere. An "
            "arm that differs from the reference evenly (a kernel's numerics) is not flagged; one "
            "whose KL jumps where the prefill is cut is.",
            [_family_table(table, "chunk", ["cached_median", "distinct"])], ["chunk_kl"]))
    if (table.family == "longgen").any():
        out.append(Section(
            "Long generations: where the engine leaves the reference along its own output",
            "Each probe prompt is generated to the token cap, greedily and sampled; the engine is "
            "then asked the same tokens again as one prompt (a re-read in one prefill, none of the "
            "state the decode built), and the reference computed here scores both teacher-forced "
            "(KL against what the engine reported, before each token). `floor` is the re-read; each "
            "stretch `steps@a` (from step 0) is flagged when its KL is above the re-read's at the "
            "same positions (Wilcoxon signed-rank, p < 0.05, at least 4x in the mean). The second "
            "table is the one judgement per arm and run, read by the verdict: flagged for a "
            "flagged stretch, or for a misbehaviour (loops: a tail with under 30% distinct 8-grams; "
            "thinking until the cap; special tokens in the text; early EOS) more frequent than in "
            "the first arm's same run (one-sided Fisher exact test, p < 0.05).",
            [_family_table(table, "longgen", ["cached_median", "distinct", "diverged", "first_step"]),
             Table(_flagged_first(behaviour), fold=False)], ["drift"]))
    return out


# family -> (what its conditions are, in a headline; what its floor compares)
FAMILY = {"prefix": ("prefix-cache conditions", "between two cold starts"),
          "batch": ("conditions with other requests in flight", "between two replies alone"),
          "chunk": ("prefill chunk boundaries", "just before the boundary")}
SUSPECTS_CAPTION = ("One row per flagged condition (and long-generation run), strongest first: greedy "
                    "tokens that part before numerics that move, then the larger KL (over the generated "
                    "tokens). `floor KL`: the KL the same comparison has under the reference "
                    "condition (two cold starts, two replies alone, the engine's re-read of its own output; "
                    "chunk: the means after and before the boundary, in `why`); 0 is bit-identical.")
SUSPECT_ROWS = 12


def _place(r) -> str:
    """Where a condition is, in words."""
    cls, shared = r["class"], r["shared"]
    if cls == "chunk-boundary":
        return f"prefill chunk boundary at token {int(shared)}"
    if cls == "full":
        return "a full-prompt hit"
    if cls == "multi-turn":
        return "a second chat turn re-sending the first"
    if cls == "eviction":
        return f"the prompt again after {int(shared)} tokens of other prompts (eviction)"
    if cls == "concurrency":
        return f"{int(shared)} other request{'s' if int(shared) != 1 else ''} in flight"
    return f"a prefix hit sharing {int(shared)} tokens ({cls} boundary)"


def _floor_kl(table: pd.DataFrame, r) -> tuple[float, bool]:
    """The KL of a condition's floor (its own arm and family) and whether the floor is exact."""
    f = table[(table.arm == r.arm) & (table.family == r.family) & (table.condition == floor_of(r.family, r.condition))]
    if f.empty:
        return float("nan"), False
    return float(f.kl_max.max()), bool((f.bitwise == f.probes).all() and f.kl_max.max() == 0)


def suspects(table: pd.DataFrame, behaviour: pd.DataFrame) -> pd.DataFrame:
    """One row per flagged condition (long generations: per flagged arm and run), strongest
    first: parted greedy tokens before moved numerics, then the larger KL."""
    rows = []
    for _, r in table[table.flagged & (table.family != "longgen")].iterrows():
        # chunk: the flag compares the means of the windows after and before the boundary
        # (quoted in `why`); the window before's largest KL is no floor for this one's
        floor = float("nan") if r.family in BEFORE else _floor_kl(table, r)[0]
        rows.append({"arm": r.arm, "family": r.family, "condition": r.condition, "where": _place(r),
                     "replies changed": f"{int(r.probes - r.bitwise)}/{int(r.probes)}",
                     "greedy tokens part": (f"{int(r.diverged)}/{int(r.probes)} from step {int(r.first_step)}"
                                            if r.diverged else "never"),
                     "kl_max": float(r.kl_max), "floor": floor, "why": r.why, "_part": int(r.diverged)})
    if behaviour is not None and len(behaviour) and "flagged" in behaviour:
        for _, r in behaviour[behaviour.flagged].iterrows():
            start = r.drift_start_min if pd.notna(r.get("drift_start_min")) else r.get("first_flagged")
            rows.append({"arm": r.arm, "family": "longgen", "condition": r["mode"],
                         "where": f"its {r['mode']} long generation"
                                  + (f" from step {int(start)}" if pd.notna(start) else ""),
                         "replies changed": f"{int(r.generations)}/{int(r.generations)}",
                         "greedy tokens part": "–", "kl_max": float(r.kl_max),
                         "floor": float(r.floor_kl_max), "why": r.why, "_part": 1})
    cols = ["arm", "family", "condition", "where", "replies changed", "greedy tokens part", "kl_max", "floor", "why"]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows).sort_values(["_part", "kl_max"], ascending=False, kind="stable")
    return df[cols].reset_index(drop=True)


def headline(table: pd.DataFrame, behaviour: pd.DataFrame, sus: pd.DataFrame) -> str:
    """One sentence: the strongest finding (which arm, under which condition, its KL against
    its floor, how many of the family's conditions), the other flagged arms named after it;
    or that nothing changed, over how many conditions."""
    judged = table[~floors_mask(table) & (table.family != "longgen").to_numpy()]
    if sus.empty:
        runs = len(behaviour) if behaviour is not None else 0
        exact = bool(len(judged)) and bool((judged.bitwise == judged.probes).all())
        more = f" and {runs} long-generation run{'s' if runs != 1 else ''}" if runs else ""
        return (f"No serving condition changes any arm's replies: {len(judged)} condition"
                f"{'s' if len(judged) != 1 else ''}{more} over "
                f"{table.arm.nunique()} arm{'s' if table.arm.nunique() != 1 else ''}, each within its floor"
                + (" (every reply bit-identical)." if exact else "."))
    top = sus.iloc[0]
    first = _finding(table, behaviour, top)
    others = []
    for (arm, fam), g in sus.iloc[1:].groupby(["arm", "family"], sort=False):
        if (arm, fam) == (top.arm, top.family):
            continue
        n = len(judged[(judged.arm == arm) & (judged.family == fam)]) if fam != "longgen" else None
        others.append(f"`{arm}` ({fam}, {len(g)} of {n})" if n else f"`{arm}` ({fam}, {', '.join(g.condition)})")
    also = ""
    if others:
        also = "; also " + ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return first + also + "."


def _finding(table: pd.DataFrame, behaviour: pd.DataFrame, top) -> str:
    """The strongest suspect row in words: what, where, how much against its floor."""
    if top.family == "longgen":
        return (f"`{top.arm}` leaves the reference along {top['where'].replace('its ', 'its own ', 1)}: "
                f"KL up to {top.kl_max:.3g} generating vs {top.floor:.3g} re-reading the same tokens")
    g = table[(table.arm == top.arm) & (table.family == top.family)]
    judged = g[~floors_mask(g)]
    hits = judged[judged.flagged]
    what, floor_words = FAMILY[top.family]
    verb = ("changes its replies" if hits.diverged.any()
            else "changes its replies' numerics (not its greedy tokens)")
    if top.family in BEFORE:
        return (f"`{top.arm}` jumps in KL after {len(hits)} of {len(judged)} {what}, most at token "
                f"{int(judged[judged.condition == top.condition].shared.iloc[0])}: {top.why.split(' (')[0]}")
    r = judged[judged.condition == top.condition].iloc[0]
    floor, exact = _floor_kl(table, r)
    fl = "0 (bit-identical)" if exact else f"{floor:.3g}"
    return (f"`{top.arm}` {verb} under {len(hits)} of {len(judged)} {what}: KL up to {top.kl_max:.3g} over "
            f"the generated tokens at {top['where']} vs {fl} {floor_words}")


def next_steps(m: dict, sus: pd.DataFrame) -> list[str]:
    """`fidelity consistency` commands that would sharpen the finding, spelled as its parser
    takes them (tests/test_consistency_page.py parses every one): per flagged arm and
    family (strongest first, at most three), that family alone on that arm with more probes
    -- and longer replies, more company, the reference, longer generations as the family
    needs; with nothing flagged, every arm again with more probes."""
    q = shlex.quote
    arms = {a["name"]: a for a in m["arms"]}
    st = m["settings"]
    ref = m.get("reference") or {}
    inproc = f" --arm {q(ref['name'] + '=' + ref['arm'])}" if ref.get("name") and ref.get("arm") else ""
    ck = f" --checkpoint {q(str(m['checkpoint']))}" if m.get("checkpoint") else ""

    def ep(names):
        return " ".join(f"--endpoint {q(n + '=' + arms[n]['url'])}" for n in names if n in arms)

    more = lambda n: max(8, 3 * int(n or 1))                   # noqa: E731
    if sus.empty:
        spec = st.get("spec", {}).get("baseline")
        fams = ",".join(f for f in st["families"] if f in ("prefix", "batch") or inproc or (f == "spec" and spec))
        models = " ".join(f"--model {q(n + '=' + a['model'])}" for n, a in arms.items() if a.get("model"))
        return ["# more probes: still nothing flagged with more power?",
                f"fidelity consistency{ck} {ep(arms)}{' ' + models if models else ''}{inproc} --families {fams} "
                f"--probes {more(st['prefix']['probes'])}" + (f" --spec-baseline {q(spec)}" if spec and "spec" in fams
                                                              else "")]
    out = []
    for (arm, fam), g in sus.groupby(["arm", "family"], sort=False):
        if arm not in arms or len(out) >= 6:          # three findings, a comment and a command each
            continue
        base = f"fidelity consistency{ck} {ep([arm])}"
        a = arms[arm]
        if fam == "prefix":
            p = st["prefix"]
            page = f" --page-size {int(a['page_size'])}" if a.get("page_size") else ""
            why = ("how often does a hit change the answer?" if (g["greedy tokens part"] != "never").any()
                   else "does a hit change the greedy answer further on?")
            out += [f"# {arm}: {why}", f"{base} --families prefix --probes {more(p['probes'])} --max-tokens "
                    f"{max(32, 4 * int(p['max_tokens']))}{page}"]
        elif fam == "batch":
            b = st["batch"]
            out += [f"# {arm}: from how many requests in flight, and how often?",
                    f"{base} --families batch --probes {more(b['probes'])} --concurrency 1,8,32,64 "
                    f"--repeats {max(4, int(b['repeats']))}"]
        elif fam == "chunk" and inproc:
            chunk = f" --chunk-size {int(a['chunked_prefill_size'])}" if a.get("chunked_prefill_size") else ""
            out += [f"# {arm}: every boundary again, on more prompts",
                    f"{base}{inproc} --families chunk --probes {more(st['chunk']['probes'])}{chunk}"]
        elif fam == "longgen" and inproc:
            out += [f"# {arm}: where along a longer output it starts, on more prompts",
                    f"{base}{inproc} --families longgen --probes {more(st['longgen']['probes'])} "
                    f"--gen-tokens {2 * int(st['longgen']['max_tokens'])}"]
    return out


def _plan_words(family: str, plan: dict) -> str:
    if family == "longgen":
        return (f"longgen: {plan['probes']} chat tasks (thinking {'on' if plan['thinking'] else 'off'}) "
                f"to {plan['max_tokens']} tokens, greedy" + (f" and sampled at T={plan['temperature']:g}"
                                                              if plan["temperature"] > 0 else ""))
    length = plan.get("length") or "1.5 chunks of"
    return f"{family}: {plan['probes']} probe prompts of {length} tokens"


def build_page(result: dict) -> Page:
    m, table = result["manifest"], result["conditions"]
    arms = ", ".join(f"`{a['name']}` ({a['dialect']}, model {a['model']})" for a in m["arms"])
    fams = m["settings"]["families"]
    plans = "; ".join(_plan_words(f, m["settings"][f]) for f in fams)
    compared = f"Arms {arms} on {m['checkpoint']}'s tokenizer. Families {plans}; {m['seconds']} s."
    how = pd.DataFrame([{"arm": a["name"], "url": a["url"], "dialect": a["dialect"],
                         "cold start by": a.get("cold_by"), "page size": a.get("page_size"),
                         "prefill chunk": a.get("chunked_prefill_size"),
                         "requests": sum(v for k, v in m["requests"].items() if k.endswith("/" + a["name"])),
                         "retries": sum(a.get("retries", {}).values()),
                         "cache re-runs": a.get("cache_reruns", 0)} for a in m["arms"]])
    sections = _sections(table, result.get("behaviour", pd.DataFrame())) + [
        Section("How it was run", "Cold starts use the engine's flush route (SGLang "
                "`/flush_cache`, vLLM `/reset_prefix_cache`); without one, two random leading tokens "
                "no earlier request had. Retries are transport faults retried under the shared "
                "policy, never counted as differences. Cache re-runs: replies that took more prompt "
                "tokens from the cache than their condition allows (a cold one any; a hit@P more "
                "than P: a retry of a request the server had processed), discarded, the cache "
                "flushed and the condition asked again.", [Table(how, fold=False)]),
        Section("Every probe", "One row per comparison (probes.csv).",
                [Table(result["probes"].drop(columns=["key", "tokens", "kl", "rank", "kl_window", "kl_floor",
                                                       "floor_window", *SPEC_LISTS],
                                              errors="ignore"), fold=True)]),
    ]
    spec = result.get("spec", pd.DataFrame())
    if len(spec):
        sections.insert(0, Section(
            "Speculative decoding: on vs off",
            "Each arm against the same model served without speculation (`baseline`): greedy "
            "replies token by token and logprob by logprob (the baseline asked twice is the "
            "floor), sampled replies over seeds (seed-identical replies; `agree_*`: how often two "
            "samples hold the same token, compared by a permutation test, `p_distribution`), "
            "special tokens the speculative reply injects, greedy tokens that are not the top-1 of "
            "their own reported distribution (`off_top1`, the baseline's beside it), the drafts per "
            "verify the server reports (`k_served`) and the engine's acceptance counts where it "
            "reports them; a flagged arm's first-draft acceptance (`accept_first`) is set against "
            "the first lossless arm at the same drafts per verify (`accept_reference`, one-sided "
            "`p_accept_above`): accepting more than a correct verifier is wrong acceptance "
            "(fidelity/consistency/spec_judge.py).",
            [Table(_flagged_first(spec), fold=False)], [] if spec.flagged.any() else ["spec_kl"]))
    behaviour = result.get("behaviour", pd.DataFrame())
    sus = suspects(table, behaviour)
    shown = sus.head(SUSPECT_ROWS).rename(columns={"kl_max": "KL max", "floor": "floor KL"})
    caption = SUSPECTS_CAPTION + (f" {len(sus) - SUSPECT_ROWS} more in the tables below." if len(sus) > SUSPECT_ROWS
                                  else "")
    return Page("dsv4-fidelity consistency report", compared, result["verdict"],
                lead_figures=["spec_kl"] if len(spec) and spec.flagged.any() else ["prefix_kl"],
                suspects=Table(shown, caption=caption, fold=False) if len(sus) else None,
                next_steps=spec_next_steps(m, spec) + (next_steps(m, sus) if len(sus) or not len(spec)
                                                        or not spec.flagged.any() else []),
                sections=sections, manifest=m,
                headline=_with_spec(headline(table, behaviour, sus), spec, sus))


def spec_next_steps(m: dict, spec: pd.DataFrame) -> list[str]:
    """Per flagged spec arm: the spec family alone on it and its baseline, with more probes
    and seeds (parsed like every next step)."""
    if not len(spec) or not spec.flagged.any():
        return []
    q = shlex.quote
    arms = {a["name"]: a for a in m["arms"]}
    st = m["settings"]["spec"]
    ck = f" --checkpoint {q(str(m['checkpoint']))}" if m.get("checkpoint") else ""
    out = []
    for _, r in spec[spec.flagged].head(3).iterrows():
        names = [n for n in (r.arm, r.baseline) if n in arms]
        eps = " ".join(f"--endpoint {q(n + '=' + arms[n]['url'])}" + (f" --model {q(n + '=' + arms[n]['model'])}"
                                                                     if arms[n].get("model") else "") for n in names)
        out += [f"# {r.arm}: how early and how often, with more prompts and seeds?",
                f"fidelity consistency{ck} {eps} --spec-baseline {q(r.baseline)} --families spec "
                f"--probes {max(8, 3 * int(st['probes']))} --spec-seeds {max(16, 2 * int(st['seeds']))}"]
    return out


def _with_spec(line: str, spec: pd.DataFrame, sus: pd.DataFrame) -> str:
    """The headline with a flagged spec arm first (the spec family is judged on its own)."""
    if not len(spec) or not spec.flagged.any():
        return line
    from .spec_judge import spec_lines
    first = spec_lines(spec[spec.flagged])[0]
    return first + (f" Also: {line}" if len(sus) else "")


def write_report(out_dir, run_id: str, result: dict):
    w = ReportWriter(out_dir, run_id)
    try:
        w.table("conditions", result["conditions"])
        w.table("probes", result["probes"].drop(columns=["reference"], errors="ignore"))
        if len(result.get("behaviour", [])):
            w.table("behaviour", result["behaviour"])
        if len(result.get("spec", [])):
            w.table("spec", result["spec"])
        w.json("manifest", {**result["manifest"], "verdict": result["verdict"]})
        for stem, (draw, title) in FIGURES.items():
            fig = draw(result["conditions"], result["probes"])
            if fig is not None:
                w.figure(fig, stem, title, CAPTIONS.get(stem, ""))
                plt.close(fig)
        page = build_page({**result, "probes": result["probes"].drop(columns=["reference"], errors="ignore")})
        w.page(page)
        return w.commit(latest=False)
    except BaseException:
        w.abort()
        raise
