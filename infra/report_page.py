"""One layout for every report a person reads (ab, kld, needle, chat-check, engines,
weights-diff): the finding and its picture on the first screen, then the evidence.

A `Page` says what was compared (one line), a one-sentence headline (what broke, where,
how much against its floor) with the verdict's full wording folded under it, the lead
plot(s), a short suspects table and the commands worth running next; then sections, each
a text, its tables and the plots that explain them. Tables are printed at 3 significant
figures (full precision stays in the CSVs; lists as comma-separated words, never as a
Python repr), long text cells wrap (an explanation column is read, not scrolled to), wide
tables scroll inside their own box, long ones are folded in <details> with a one-line
summary, and cells can be coloured by their ratio to a floor. Prose (and the cells of a
`markup` table) may link to other files with Markdown's [text](relative/path). The
manifest comes last, folded. The same page renders to self-contained HTML (PNGs inlined)
and to Markdown in the same order (summary.md, what people paste into issues)."""
from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

FOLD_ROWS = 15                 # tables longer than this are folded (HTML) / cut (Markdown)
MD_ROWS = 30                   # rows of a folded table that summary.md still shows

CSS = """
body{font-family:system-ui,sans-serif;max-width:1320px;margin:1.2em auto;padding:0 1.2em;color:#222}
h1{font-size:1.6em;margin:.2em 0}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.compared{color:#444;margin:.2em 0 .8em}
.verdict{font-size:1.1em;padding:.5em .8em;background:#fff6e0;border-left:4px solid #e0a000;margin:.4em 0}
.verdict p{margin:.25em 0}.verdict p.headline{font-size:1.2em;font-weight:600;overflow-wrap:anywhere}
.verdict details{font-size:.9em;color:#333}.verdict li{margin:.2em 0}
.lead{display:flex;gap:1em;align-items:flex-start;flex-wrap:wrap}
.lead figure{flex:1 1 560px;margin:.4em 0;min-width:0}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:13px;margin:.3em 0}
td,th{border:1px solid #ccc;padding:2px 7px;text-align:right;white-space:nowrap}
th{background:#f3f3f3;position:sticky;top:0}td.t{text-align:left}
td.w{white-space:normal;min-width:16em;max-width:48em;overflow-wrap:anywhere}
td.r1{background:#fde0c5}td.r2{background:#f7a78a}td.r3{background:#e8604c;color:#fff}
img{max-width:100%;height:auto}figure{margin:1em 0}figcaption{color:#555;font-size:13px}
details{margin:.4em 0}summary{cursor:pointer;color:#1a4f8a}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:12px}
code{background:#f3f3f3;padding:0 .25em}.legend{font-size:12px;color:#555}
"""


WRAP_CHARS = 40                # a text cell longer than this wraps instead of widening its table


def fmt(v) -> str:
    """3 significant figures for floats, integers as integers, '–' for missing; lists and
    dicts as words (`engine, wo_a_fp8`; `k=v`), so a reader never sees `['engine']`."""
    if v is None:
        return "–"
    if isinstance(v, (list, tuple, set, frozenset, np.ndarray)):
        items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else list(v)
        return ", ".join(fmt(x) for x in items) if items else "–"
    if isinstance(v, dict):
        return ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) if v else "–"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "–"
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        if v == int(v) and abs(v) < 1e6:
            return str(int(v))
        return f"{v:.3g}"
    return str(v)


@dataclass
class Table:
    """A table as a person reads it. `ratio` (same index/columns as df, or a subset of its
    columns) colours cells by their value over a floor: > 1, > 3, > 10. `fold`: None =
    folded when longer than FOLD_ROWS. `summary`: the line shown on the fold. `markup`:
    text cells hold the pages' little Markdown (`code`, **bold**, [links](path))."""
    df: pd.DataFrame
    caption: str = ""
    ratio: pd.DataFrame | None = None
    fold: bool | None = None
    summary: str = ""
    markup: bool = False

    def folded(self) -> bool:
        return self.fold if self.fold is not None else len(self.df) > FOLD_ROWS


@dataclass
class Section:
    title: str
    text: str = ""                                   # HTML-safe prose (Markdown-ish inline code allowed)
    tables: list[Table] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)   # figure stems registered with the writer


@dataclass
class Page:
    title: str
    compared: str                                    # one line: model, arms, lengths
    verdict: list[str]                               # sentences, one per line (mechanism / outcome ...)
    lead_figures: list[str] = field(default_factory=list)
    suspects: Table | None = None
    next_steps: list[str] = field(default_factory=list)   # shell commands
    sections: list[Section] = field(default_factory=list)
    manifest: dict | None = None
    headline: str = ""                               # one sentence first; `verdict` then folded under it
    suspects_title: str = "Suspects"


LINK = re.compile(r"\[([^\]]+)\]\(((?:https?://)?[^():\s]+)\)")     # relative paths and http(s) only


def _inline(text: str) -> str:
    """Escape, then the little Markdown the pages use: `code`, **bold**, [text](href)
    links, line breaks."""
    parts = html.escape(text).split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    bold = out.split("**")
    out = "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(bold)) if len(bold) % 2 else out
    out = LINK.sub(lambda m: f"<a href='{m.group(2)}'>{m.group(1)}</a>", out)     # already escaped
    return out.replace("\n", "<br>")


def _ratio_class(r) -> str:
    try:
        r = float(r)
    except (TypeError, ValueError):
        return ""
    if math.isnan(r) or r <= 1:
        return ""
    return "r3" if r > 10 else "r2" if r > 3 else "r1"


def table_html(t: Table) -> str:
    df = t.df
    if df is None or len(df) == 0:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for i in range(len(df)):
        cells = []
        for j, c in enumerate(df.columns):
            v = df.iat[i, j]
            cls = []
            text = fmt(v)
            if not isinstance(v, (int, float, np.integer, np.floating, bool, np.bool_)) and v is not None:
                cls.append("t")
                if len(text) > WRAP_CHARS:
                    cls.append("w")
            if t.ratio is not None and c in t.ratio.columns and i < len(t.ratio):
                rc = _ratio_class(t.ratio[c].iloc[i])
                if rc:
                    cls.append(rc)
            attr = f" class='{' '.join(cls)}'" if cls else ""
            title = ""
            if isinstance(v, (float, np.floating)) and not math.isnan(v):
                title = f" title='{float(v)!r}'"
            cells.append(f"<td{attr}{title}>{_inline(text) if t.markup and 't' in cls else html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    body = (f"<div class='scroll'><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")
    cap = f"<p class='legend'>{_inline(t.caption)}</p>" if t.caption else ""
    if t.ratio is not None:
        cap += ("<p class='legend'>Cell colour: value over its floor &gt; 1 "
                "<span style='background:#fde0c5'>&nbsp;&nbsp;&nbsp;</span>, &gt; 3 "
                "<span style='background:#f7a78a'>&nbsp;&nbsp;&nbsp;</span>, &gt; 10 "
                "<span style='background:#e8604c'>&nbsp;&nbsp;&nbsp;</span>.</p>")
    if t.folded():
        summary = t.summary or f"{len(df)} rows"
        return f"<details><summary>{_inline(summary)}</summary>{cap}{body}</details>"
    return cap + body


def table_markdown(t: Table) -> str:
    df = t.df
    if df is None or len(df) == 0:
        return "None."
    shown = df.head(MD_ROWS) if t.folded() else df
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    for i in range(len(shown)):
        lines.append("| " + " | ".join(fmt(shown.iat[i, j]).replace("|", "\\|")
                                         for j in range(len(df.columns))) + " |")
    out = "\n".join(lines)
    if t.folded():
        out = f"{t.summary or f'{len(df)} rows'}" + (
            f" (first {MD_ROWS} shown; all in the CSV)" if len(df) > MD_ROWS else "") + "\n\n" + out
    if t.caption:
        out = t.caption + "\n\n" + out
    return out


class FigureStore:
    """Where a page finds its figures: stem -> (file name, title, caption), files in `root`."""

    def __init__(self, root: Path, figures: list[tuple[str, str, str]]):
        self.root = Path(root)
        self.by_stem = {Path(f).stem: (f, title, cap) for f, title, cap in figures}

    def html(self, stem: str) -> str:
        if stem not in self.by_stem:
            return ""
        file, title, cap = self.by_stem[stem]
        data = base64.b64encode((self.root / file).read_bytes()).decode()
        return (f"<figure><h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' "
                f"src='data:image/png;base64,{data}'><figcaption>{_inline(cap)}</figcaption></figure>")

    def markdown(self, stem: str) -> str:
        if stem not in self.by_stem:
            return ""
        file, title, cap = self.by_stem[stem]
        return f"![{title}]({file})\n\n*{cap}*" if cap else f"![{title}]({file})"


def _placed(page: Page) -> list[str]:
    return page.lead_figures + [f for s in page.sections for f in s.figures]


def _verdict_html(page: Page) -> str:
    """The headline alone on the first screen, the verdict's full wording folded under it
    (a paragraph of findings is read after the picture, not before); without a headline,
    the verdict's lines as they are."""
    if not page.headline:
        return "<div class='verdict'>" + "".join(f"<p>{_inline(s)}</p>" for s in page.verdict) + "</div>"
    more = ""
    if page.verdict:
        more = (f"<details><summary>The verdict in full ({len(page.verdict)} "
                f"finding{'s' if len(page.verdict) != 1 else ''})</summary><ul>"
                + "".join(f"<li>{_inline(s)}</li>" for s in page.verdict) + "</ul></details>")
    return f"<div class='verdict'><p class='headline'>{_inline(page.headline)}</p>{more}</div>"


def render_html(page: Page, store: FigureStore) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' "
           f"content='width=device-width'><title>{html.escape(page.title)}</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>{html.escape(page.title)}</h1>",
           f"<p class='compared'>{_inline(page.compared)}</p>", _verdict_html(page)]
    lead = [store.html(s) for s in page.lead_figures if s in store.by_stem]
    if lead:
        out.append("<div class='lead'>" + "".join(lead) + "</div>")
    if page.suspects is not None:
        out += [f"<h2>{html.escape(page.suspects_title)}</h2>", table_html(page.suspects)]
    if page.next_steps:
        out += ["<h2>What to run next</h2>",
                "<pre>" + "\n".join(html.escape(c) for c in page.next_steps) + "</pre>"]
    for s in page.sections:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.text:
            out.append(f"<p>{_inline(s.text)}</p>")
        out += [table_html(t) for t in s.tables]
        out += [store.html(f) for f in s.figures]
    rest = [f for f in store.by_stem if f not in _placed(page)]
    if rest:
        out.append("<h2>More plots</h2>")
        out += [store.html(f) for f in rest]
    if page.manifest is not None:
        out.append("<h2>Run</h2><details><summary>manifest (settings, arms, prompts, versions)"
                   "</summary><pre>" + html.escape(json.dumps(page.manifest, indent=2, default=str))
                   + "</pre></details>")
    out.append("</body></html>")
    return "\n".join(out)


def render_markdown(page: Page, store: FigureStore) -> str:
    out = [f"# {page.title}", "", page.compared, ""]
    if page.headline:
        out += [f"**Verdict.** {page.headline}", ""] + [f"- {s}" for s in page.verdict] + [""]
    else:
        for i, sentence in enumerate(page.verdict):
            out += [f"**Verdict.** {sentence}" if i == 0 else sentence, ""]
    out += [store.markdown(s) + "\n" for s in page.lead_figures if s in store.by_stem]
    if page.suspects is not None:
        out += [f"## {page.suspects_title}", "", table_markdown(page.suspects), ""]
    if page.next_steps:
        out += ["## What to run next", "", "```bash", *page.next_steps, "```", ""]
    for s in page.sections:
        out += [f"## {s.title}", ""]
        if s.text:
            out += [s.text, ""]
        for t in s.tables:
            out += [table_markdown(t), ""]
        out += [store.markdown(f) + "\n" for f in s.figures if f in store.by_stem]
    rest = [f for f in store.by_stem if f not in _placed(page)]
    if rest:
        out += ["## More plots", ""] + [store.markdown(f) + "\n" for f in rest]
    if page.manifest is not None:
        out += ["Run settings, arms and prompts: `manifest.json`.", ""]
    return "\n".join(out)
