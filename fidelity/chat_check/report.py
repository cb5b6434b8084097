"""The chat-check report: Markdown + HTML like the other reports, cases.csv, and the run's
manifest (endpoint, the engine's own view, generation, engine profile, how prompt ids were
obtained). `failed` = any undocumented difference, error or behaviour problem."""
from __future__ import annotations

import pandas as pd

from fidelity.report_io import ReportWriter, df_to_html, df_to_markdown

FAIL = ("differs", "error")
COLUMNS = ["case", "status", "reference_state", "engine_state", "became", "behaviour", "detail"]


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


def write(rows: list[dict], meta: dict, out_dir, run_id: str):
    df = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    wrong = df.behaviour.notna() & (df.behaviour != "ok")
    failed = bool(df.status.isin(FAIL).any() or wrong.any())
    counts = df.status.value_counts().rename_axis("status").reset_index(name="cases")
    bad = df[df.status.isin(FAIL) | wrong][COLUMNS]
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
        w.json("manifest", {"meta": meta, "verdict": verdict, "failed": failed,
                            "counts": dict(zip(counts.status, counts.cases.astype(int)))})
        md = ["# dsv4-fidelity chat-check", "", f"**{verdict}.**", "",
              f"Endpoint `{meta['endpoint']['url']}` (model `{meta['endpoint']['model']}`); reference: "
              f"deepseek-recipe, generation `{meta['generation']}`; engine profile "
              f"`{meta['engine_profile'] or 'none'}`; prompt ids via `{meta['method']}`, raw text tokenized "
              f"by `{meta['raw_tokenizer']}`.", "", "## Cases by status", "", df_to_markdown(counts), "",
              "## Differences, errors and behaviour problems", "",
              df_to_markdown(bad) if len(bad) else "None.", "",
              "All cases: `cases.csv`.", ""]
        w.text("summary.md", "\n".join(md))
        w.html("dsv4-fidelity chat-check", f"<p class='verdict'>{verdict}.</p>",
               [("Cases by status", df_to_html(counts)),
                ("Differences, errors and behaviour problems", df_to_html(bad) if len(bad) else "<p>none</p>"),
                ("All cases", df_to_html(df[COLUMNS]))])
        return w.commit(), failed
    except BaseException:
        w.abort()
        raise
