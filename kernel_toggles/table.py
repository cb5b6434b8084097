"""The registry as a table: plain text for `fidelity toggles`, Markdown for the README."""
from __future__ import annotations

from . import registry as R

COLUMNS = ("name", "category", "kernel", "provenance", "parameters")


_MODEL_NAMES = {"v4": "V4", "v41": "V4.1"}


def _models(t) -> str:
    """' [V4.1 only]' for a toggle documented for one model version (its engine arm)."""
    if set(t.versions) == set(R.VERSIONS):
        return ""
    return " [" + ", ".join(_MODEL_NAMES[v] for v in t.versions) + " only]"


def rows(toggles=None) -> list[dict]:
    ts = toggles if toggles is not None else R.all_toggles()
    out = []
    for t in ts:
        out.append({
            "name": t.name + (" [decode]" if t.phase == "decode" else "") + _models(t),
            "category": t.category,
            "kernel": ", ".join(t.kernels),
            "provenance": t.provenance.short(),
            "parameters": t.param_summary() or "-",
            "group": t.group or "",
            "description": t.description,
        })
    return out


def render_text(toggles=None, width: int = 60) -> str:
    """Fixed-width table; long cells are cut at `width` characters (see --markdown for all)."""
    rs = rows(toggles)

    def cut(s):
        return s if len(s) <= width else s[: width - 1] + "…"
    cells = [[cut(r[c]) for c in COLUMNS] for r in rs]
    w = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
         for i, c in enumerate(COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w[i]) for i, v in enumerate(vals)).rstrip()
    out = [line(COLUMNS), line(["-" * x for x in w])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(toggles=None) -> str:
    """The README toggle table (one row per toggle, full description and provenance)."""
    head = ("| Toggle | Category | Replaces | Engine behaviour reproduced | Provenance | "
            "Parameters |\n|---|---|---|---|---|---|")
    lines = [head]
    for r in rows(toggles):
        kern = ", ".join(f"`{k}`" for k in r["kernel"].split(", "))
        lines.append(f"| `{_md(r['name'])}` | {r['category']} | {kern} | {_md(r['description'])} "
                     f"| {_md(r['provenance'])} | {_md(r['parameters'])} |")
    return "\n".join(lines) + "\n"
