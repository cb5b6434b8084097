"""The chat-check report on the common page layout (verdict: the counts, then the cause of
each kind of difference; a thinking × effort status grid in the request's own order; the
causes as suspects with the commands that fit them; the failing cases), cases.csv, and the
run's manifest (endpoint, the engine's own view, chat version and generation, engine
profile, how prompt ids were obtained). `failed` = any undocumented difference, error or
behaviour problem."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from fidelity.chat_check.cases import EFFORTS, THINKING
from fidelity.chat_check.causes import cause_table, causes, label, next_steps, verdict_lines

FAIL = ("differs", "error")
# the cause before the long columns: a reader sees why a case failed without scrolling right
COLUMNS = ["case", "status", "cause", "reproduced_by", "behaviour", "reference_state", "engine_state", "detail"]


def headline(df, wrong) -> str:
    """Each kind of failure counted under its own name, so a behaviour problem on a
    documented row is never announced as an undocumented rendering difference."""
    parts = []
    n = int((df.status == "differs").sum())
    if n:
        parts.append(f"{n} case(s) differ from DeepSeek's encoder without a documented reason")
    n = int((df.status == "error").sum())
    if n:
        parts.append(f"{n} case(s) refused by the engine")
    n = int(wrong.sum())
    if n:
        parts.append(f"{n} case(s) whose response does not behave as their rendering says")
    return "; ".join(parts)


def _axis(case: str, key: str) -> str:
    m = re.search(rf"{key}=([^-]+)", case)
    return m.group(1) if m else "absent"


def in_order(values, order: list[str]) -> list[str]:
    """`values` in the request's own order (absent, none, low, medium, high, max, xhigh),
    anything unknown after it: an alphabetical axis puts high before low."""
    rank = {v: i for i, v in enumerate(order)}
    return sorted(set(values), key=lambda v: (rank.get(v, len(rank)), v))


def status_grid(df: pd.DataFrame):
    """Thinking setting × reasoning effort: each cell coloured by the share of its cases that
    fail (differ or are refused), with that count; behaviour problems marked '!'. Where an
    engine reads a request parameter differently, a whole row or column darkens; a cell with
    one failing case of six stays pale (a worst-status colour made such grids solid red)."""
    import matplotlib.pyplot as plt
    d = df.assign(think=[_axis(c, "think") for c in df.case], effort=[_axis(c, "effort") for c in df.case])
    thinks = in_order(d.think, [label(v) for v in THINKING])
    efforts = in_order(d.effort, [label(v) for v in EFFORTS])
    z = np.full((len(thinks), len(efforts)), np.nan)
    fig, ax = plt.subplots(figsize=(2.2 + 0.85 * len(efforts), 1.0 + 0.5 * len(thinks)))
    for (t, e), g in d.groupby(["think", "effort"]):
        i, j = thinks.index(t), efforts.index(e)
        failing = int(g.status.isin(FAIL).sum())
        z[i, j] = failing / len(g)
        bad = int((g.behaviour.notna() & (g.behaviour != "ok")).sum())
        ax.text(j, i, f"{failing}/{len(g)}" + ("!" if bad else ""), ha="center", va="center", fontsize=9,
                fontweight="bold" if bad else "normal", color="white" if z[i, j] > 0.6 else "black")
    cmap = plt.get_cmap("Reds").with_extremes(bad="#f0f0f0")
    im = ax.imshow(np.ma.masked_invalid(z), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(efforts)), efforts)
    ax.set_yticks(range(len(thinks)), thinks)
    ax.set_xlabel("reasoning_effort in the request")
    ax.set_ylabel("thinking in the request")
    fig.colorbar(im, ax=ax, label="failing share", shrink=0.9)
    fig.tight_layout()
    return fig


def _next_steps(meta: dict, failed: bool, table: pd.DataFrame) -> list[str]:
    """Commands that fit the causes found; none for a clean run."""
    return next_steps(meta, table) if failed else []


def _encoding(meta: dict) -> str:
    if meta.get("chat_version") == "v41":
        return "DeepSeek-V4.1 encoding"
    return f"DeepSeek-V4 generation `{meta['generation']}`"


def write(rows: list[dict], meta: dict, out_dir, run_id: str):
    df = pd.DataFrame(rows)
    for c in COLUMNS + ["tools_format"]:
        if c not in df:
            df[c] = None
    df["cause"] = ["; ".join(causes(r)) or None for r in df.to_dict("records")]
    wrong = df.behaviour.notna() & (df.behaviour != "ok")
    failed = bool(df.status.isin(FAIL).any() or wrong.any())
    counts = df.status.value_counts().rename_axis("status").reset_index(name="cases")
    failing = df[df.status.isin(FAIL) | wrong]
    bad = failing[COLUMNS].reset_index(drop=True)
    why = cause_table(failing, df)
    verdict = headline(df, wrong) if failed else "Every case renders as DeepSeek's encoder does"
    if not failed and (df.status == "documented").any():
        verdict = (f"No undocumented difference: {int((df.status == 'identical').sum())} case(s) render as "
                   f"DeepSeek's encoder does, {int((df.status == 'documented').sum())} as the "
                   f"`{meta['engine_profile']}` profile documents")
    if meta.get("weak"):
        verdict += " (counts only: the engine exposes no prompt token ids, a weaker check)"
    w = ReportWriter(f"{out_dir}/chat-check", run_id)
    try:
        w.table("cases", df)
        w.table("causes", why)
        w.json("manifest", {"meta": meta, "verdict": verdict, "failed": failed,
                            "counts": dict(zip(counts.status, counts.cases.astype(int))),
                            "causes": why.to_dict("records")})
        import matplotlib.pyplot as plt
        w.figure(status_grid(df), "status_grid", "Cases by thinking × effort",
                 "Each cell: the share of its cases that fail (differ or are refused; colour) and "
                 "their count of all; '!' = a response that does not behave as its rendering says.")
        plt.close("all")
        compared = (f"Endpoint `{meta['endpoint']['url']}` (model `{meta['endpoint']['model']}`) against "
                    f"DeepSeek's encoder (deepseek-recipe, {_encoding(meta)}) on {len(df)} chat "
                    f"requests; engine profile `{meta['engine_profile'] or 'none'}`; prompt ids via "
                    f"`{meta['method']}`, raw text tokenized by `{meta['raw_tokenizer']}`.")
        page = Page("dsv4-fidelity chat-check", compared, [verdict + "."] + verdict_lines(why), ["status_grid"],
                    Table(why, fold=False, caption="Each cause of a failing case: how many cases, the request "
                          "settings they share, the known engine reading (request toggle) that renders them "
                          "exactly, and one example (every case below and in cases.csv).")
                    if len(why) else None,
                    _next_steps(meta, failed, why),
                    [Section("Cases by status", "", [Table(counts, fold=False)]),
                     Section("Differences, errors and behaviour problems", "",
                             [Table(bad, summary=f"{len(bad)} cases")]),
                     Section("All cases", "", [Table(df[COLUMNS], summary=f"{len(df)} cases")])],
                    meta)
        w.page(page)
        return w.commit(), failed
    except BaseException:
        w.abort()
        raise
