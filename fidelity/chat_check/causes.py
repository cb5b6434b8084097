"""Why a chat-check's cases fail, in words. Each failing case gets its causes (what its
prompt's thinking state became, the tool format, a refusal, a response that does not
behave), each cause the request settings its cases share and the known engine reading
(request toggle) that reproduces it exactly, and the next steps follow from those causes.
Counts alone leave the reader to open every row; the cause sat in a column cut off on the
right."""
from __future__ import annotations

import math
import re
import shlex

import numpy as np
import pandas as pd

from fidelity.chat_check.cases import EFFORTS, THINKING
from fidelity.chat_check.check import PROFILES

PROFILE_OF = {toggle: profile for profile, toggle in PROFILES.items()}   # chat_sglang_0523 -> sglang
VERDICT_CAUSES = 4                      # causes spelled out in the verdict; the rest in Suspects
KINDS = {"matrix": "single turn", "multi-turn": "multi-turn", "tool-round-trip": "tool round trip"}


def label(v, absent: str = "absent") -> str:
    """A request setting as the case ids spell it (None/NaN absent, True on, False off)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return absent
    if isinstance(v, (bool, np.bool_)):
        return "on" if v else "off"
    return str(v)


# ---- one case's causes ---------------------------------------------------------------------------
def _thinks(state) -> bool | None:
    return None if not isinstance(state, str) else state.startswith("thinking")


def state_change(ref, eng) -> str | None:
    """What the engine made of the thinking state and effort preamble, or None if unchanged."""
    if ref == eng or not isinstance(ref, str) or not isinstance(eng, str):
        return None
    if _thinks(ref) and eng == "no thinking":
        return "thinking turned off"
    if ref == "no thinking" and _thinks(eng):
        return "thinking turned on"
    if _thinks(ref) and _thinks(eng):
        if eng.endswith("no preamble"):
            return "effort preamble dropped"
        return "effort preamble added" if ref.endswith("no preamble") else "another effort preamble"
    return f"{ref} -> {eng}"


def rendering_causes(row: dict) -> list[str]:
    """The causes of a differing or refused prompt (several when thinking and tools both changed)."""
    status = row.get("status")
    if status == "error":
        return ["refused: " + re.split(r"[;\n]", str(row.get("detail") or ""), maxsplit=1)[0][:90]]
    if status != "differs":
        return []
    if label(row.get("first_diff"), "") == "":
        return ["prompt length differs (counts only)"]
    out = [c for c in (state_change(row.get("reference_state"), row.get("engine_state")),
                       row.get("tools_format")) if isinstance(c, str) and c]
    return out or ["prompt text differs, same thinking state"]


BEHAVIOUR = ((r"^thinking should be on .* no reasoning_content", "no reasoning_content though thinking is on"),
             (r"^thinking should be off .* has reasoning_content", "reasoning_content though thinking is off"),
             (r"no tool_calls", "tool call left in content (no tool_calls)"))


def behaviour_cause(row: dict) -> str | None:
    """A response problem in a few words (the whole message is in the behaviour column)."""
    b = row.get("behaviour")
    if not isinstance(b, str) or b == "ok":
        return None
    short = next((s for pat, s in BEHAVIOUR if re.search(pat, b)), b.split(":")[0][:60])
    return "response: " + short


def causes(row: dict) -> list[str]:
    """Every cause of one case: its prompt's, then its response's."""
    out = rendering_causes(row)
    b = behaviour_cause(row)
    return out + ([b] if b else [])


# ---- classes of causes -------------------------------------------------------------------------
AXES = (("thinking", "thinking_sent", [label(v) for v in THINKING]),
        ("effort", "effort_sent", [label(v) for v in EFFORTS]),
        ("tools", "tools", ["with tools", "without tools"]),
        ("system prompt", "system", ["with system prompt", "without system prompt"]),
        ("conversation", "kind", list(KINDS.values())))


def _axis_values(df: pd.DataFrame, col: str) -> list[str]:
    if col not in df:
        return []
    if col in ("tools", "system"):
        word = "tools" if col == "tools" else "system prompt"
        return [f"{'with' if label(v) == 'on' else 'without'} {word}" for v in df[col]]
    if col == "kind":
        return [KINDS.get(v, str(v)) for v in df[col]]
    return [label(v) for v in df[col]]


def pattern(sub: pd.DataFrame, every: pd.DataFrame) -> str:
    """The request settings a cause's cases share, against all cases checked ('thinking
    absent; effort any but none'); settings the cause spans entirely are left out."""
    parts = []
    for name, col, order in AXES:
        have, seen = set(_axis_values(sub, col)), set(_axis_values(every, col))
        if not have or have == seen:
            continue
        rank = {v: i for i, v in enumerate(order)}
        key = lambda v: (rank.get(v, len(rank)), v)                     # noqa: E731
        if len(have) > len(seen) / 2 and name in ("thinking", "effort"):
            parts.append(f"{name} any but {' or '.join(sorted(seen - have, key=key))}")
        elif name in ("thinking", "effort"):
            parts.append(f"{name} {' or '.join(sorted(have, key=key))}")
        else:
            parts.append(" or ".join(sorted(have, key=key)))
    return "; ".join(parts) or "every kind of request"


def _names(row: dict) -> set[str]:
    """The known readings that reproduce a case: its prompt's, or the toggle its behaviour names."""
    rep = row.get("reproduced_by")
    b = row.get("behaviour")
    return set(rep.split() if isinstance(rep, str) else []) | set(
        re.findall(r"toggle (\w+)", b) if isinstance(b, str) else [])


def _reproduced(sub: pd.DataFrame) -> str:
    """Known readings reproducing every case of a cause (less those another of them
    includes); else the best partial one, 'name (k of n)'."""
    from kernel_toggles.registry import subsumed_by
    sets = [_names(r) for r in sub.to_dict("records")]
    common = set.intersection(*sets) if sets else set()
    if common:
        return " ".join(sorted(common - subsumed_by(common), key=_toggle_rank))
    counts = pd.Series([n for s in sets for n in s], dtype=object).value_counts()
    return f"{counts.index[0]} ({int(counts.iloc[0])} of {len(sub)})" if len(counts) else ""


def _toggle_rank(name: str) -> tuple:
    """Engine profiles first: they decide whether a difference is documented."""
    return (name not in PROFILE_OF, name)


def cause_table(failing: pd.DataFrame, every: pd.DataFrame) -> pd.DataFrame:
    """One row per cause of the failing cases: how many, the request settings they share
    (against every case checked for that kind of cause), the known reading that reproduces
    them and one example case; most cases first."""
    rows = [(i, c) for i, r in zip(failing.index, failing.to_dict("records")) for c in causes(r)]
    cols = ["cause", "cases", "requests", "reproduced by", "example"]
    if not rows:
        return pd.DataFrame(columns=cols)
    pairs = pd.DataFrame(rows, columns=["i", "cause"])
    checked = every[every.behaviour.notna()] if "behaviour" in every else every
    out = []
    for cause, g in pairs.groupby("cause", sort=False):
        sub = failing.loc[g.i]
        population = checked if cause.startswith("response: ") else every
        out.append({"cause": cause, "cases": len(sub), "requests": pattern(sub, population),
                    "reproduced by": _reproduced(sub), "example": sub.case.iloc[0]})
    return pd.DataFrame(out, columns=cols).sort_values("cases", ascending=False, kind="stable").reset_index(drop=True)


# ---- words --------------------------------------------------------------------------------------
def _exact(rep) -> list[str]:
    """The readings that reproduce every case of a cause ([] for none or a partial one)."""
    return rep.split() if isinstance(rep, str) and rep and "(" not in rep else []


def _toggle(name: str):
    from kernel_toggles.registry import ToggleError, get
    try:
        return get(name)
    except ToggleError:
        return None


def where_seen(name: str) -> str:
    """'sglang: deployments before the 0.5.23 mapping': the engines and settings of a reading."""
    t = _toggle(name)
    if t is None:
        return ""
    p = t.provenance
    return "/".join(p.engines) + (": " + ", ".join(p.settings) if p.settings else "")


def verdict_lines(table: pd.DataFrame) -> list[str]:
    """One sentence per cause, most cases first (the cause, the requests it hits, the known
    reading that reproduces it); a reading behind every cause is the root cause, named once,
    first, with what it does."""
    rows = table.head(VERDICT_CAUSES).to_dict("records")
    readings = {r["reproduced by"] for r in table.to_dict("records")}
    shared = _exact(readings.pop()) if len(readings) == 1 else []
    lines = []
    for r in rows:
        s = f"**{r['cause'][0].upper() + r['cause'][1:]}** in {r['cases']} case(s) ({r['requests']})"
        if not shared and _exact(r["reproduced by"]):
            s += ": reproduced exactly by " + ", ".join(f"`{n}` ({where_seen(n)})" for n in _exact(r["reproduced by"]))
        elif not shared and r["reproduced by"]:
            s += f"; partly reproduced by `{r['reproduced by']}`"
        lines.append(s + ".")
    if len(table) > VERDICT_CAUSES:
        lines.append(f"{len(table) - VERDICT_CAUSES} more cause(s) in Suspects.")
    root = []
    for n in shared:
        t = _toggle(n)
        root.append(f"{'Every cause is reproduced' if len(table) > 1 else 'Reproduced'} exactly by `{n}` "
                    f"({where_seen(n)}){': ' + t.description if t else '.'}")
    return root + lines


# ---- next steps ---------------------------------------------------------------------------------
def rerun(meta: dict, *extra: str, profile: str | None = None) -> str:
    """This chat-check again, with the settings it ran with (and `extra`)."""
    ep = meta["endpoint"]
    args = ["fidelity", "chat-check", "--endpoint", ep["url"]]
    if len((meta.get("server") or {}).get("models") or []) > 1 and ep.get("model"):
        args += ["--model", ep["model"]]
    if meta.get("chat_version_from") == "given" and "--chat-version" not in extra:
        args += ["--chat-version", meta["chat_version"]]
    if meta.get("generation", "0731") != "0731" and "--generation" not in extra:
        args += ["--generation", meta["generation"]]
    profile = profile or meta.get("engine_profile")
    if profile:
        args += ["--engine-profile", profile]
    return shlex.join(args + list(extra))


PREAMBLE = ("effort preamble dropped", "effort preamble added", "another effort preamble")


def _steps(meta: dict, r: dict) -> list[tuple[str, str]]:
    """(command, why) pairs that test or fix one cause; [] when none fits."""
    cause, names = r["cause"], _exact(r["reproduced by"])
    profile = next((PROFILE_OF[x] for x in names if x in PROFILE_OF), None)
    if profile and not meta.get("engine_profile"):
        return [(rerun(meta, profile=profile), f"{profile}'s documented reading ({PROFILES[profile]}): "
                 "documented, not failed")]
    if "no tool_calls" in cause:
        return [(rerun(meta), "after starting the engine with the tool-call parser of the served model's "
                 "DSML (SGLang deepseekv4, vLLM deepseek_v4)")]
    if names and not profile:
        return [(rerun(meta), f"after fixing the deployment ({names[0]}: {where_seen(names[0])})"),
                (shlex.join(["fidelity", "serve", "--arm", names[0], "--port", "8001"]),
                 "the engine's reading served by the reference: try a client against it")]
    if cause in PREAMBLE and meta.get("chat_version") != "v41":
        other = "original" if meta.get("generation", "0731") == "0731" else "0731"
        return [(rerun(meta, "--generation", other), f"{cause}: if the checkpoint is the {other} "
                 "generation (its effort tiers)")]
    m = re.match(r"tools are in (\S+)'s DSML tags", cause)
    if m:
        return [(rerun(meta, "--chat-version", "v41" if m.group(1) == "DeepSeek-V4.1" else "v4"),
                 f"the engine writes {m.group(1)}'s tool format")]
    if "reasoning_content" in cause:
        return [(rerun(meta), "after starting the engine with its DeepSeek-V4 reasoning parser "
                 "(SGLang --reasoning-parser deepseek-v4, vLLM deepseek_v4)")]
    if cause.startswith("refused") and re.search(r"time|5\d\d|connect", cause, re.I):
        return [(rerun(meta, "--retries", "5", "--timeout", "300"), "if the refusals were transient")]
    if cause == "prompt text differs, same thinking state":
        return [(rerun(meta, "--tokenizer", "TOKENIZER.json"), "with the served model's tokenizer, if "
                 "the engine serves another one (the first differing tokens are in cases.csv)")]
    return []


def next_steps(meta: dict, table: pd.DataFrame) -> list[str]:
    """A command per cause that has one, most cases first; a command two causes share once,
    with the causes it answers."""
    why, answers = {}, {}
    for r in table.to_dict("records"):
        for cmd, reason in _steps(meta, r):
            why.setdefault(cmd, reason)
            answers.setdefault(cmd, []).append(r["cause"])
    return [f"{cmd}   # {_listing(answers[cmd])}: {why[cmd]}" for cmd in why]


def _listing(causes_: list[str]) -> str:
    return causes_[0] if len(causes_) == 1 else f"{len(causes_)} causes"
