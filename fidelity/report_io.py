"""Report directory I/O shared by `fidelity ab` and `fidelity needle`: atomic writes of
tables (CSV), JSON with a schema version, Markdown and a self-contained HTML page with the
PNG plots embedded, and the `reports/latest` pointer."""
from __future__ import annotations

import base64
import html
import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

SCHEMA_VERSION = 1


class ReportWriter:
    """Collects files in a hidden temp dir next to the target; `commit()` renames it into
    place, so an interrupted run never leaves a half-written report."""

    def __init__(self, out_dir: str | Path, run_id: str):
        self.root = Path(out_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{run_id}-", dir=self.root))
        self.tmp.chmod(0o755)            # mkdtemp makes 0700; results are meant to be shared
        self.figures: list[tuple[str, str, str]] = []       # (file, title, caption)

    def table(self, name: str, df: pd.DataFrame, gzip: bool = False) -> None:
        """CSV; `gzip` for the big per-row tables (pandas reads .csv.gz transparently)."""
        df.to_csv(self.tmp / f"{name}.csv{'.gz' if gzip else ''}", index=False)

    def json(self, name: str, obj) -> None:
        payload = {"schema_version": SCHEMA_VERSION, **obj}
        (self.tmp / f"{name}.json").write_text(json.dumps(payload, indent=2, default=_jsonable))

    def text(self, name: str, content: str) -> None:
        (self.tmp / name).write_text(content)

    def figure(self, fig, name: str, title: str, caption: str = "") -> None:
        fig.savefig(self.tmp / f"{name}.png", dpi=110, bbox_inches="tight")
        self.figures.append((f"{name}.png", title, caption))

    def html(self, title: str, intro_md: str, sections: list[tuple[str, str]]) -> None:
        """Self-contained page: every PNG inlined as base64."""
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
                 "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;"
                 "padding:0 1em;color:#222}table{border-collapse:collapse;font-size:13px}"
                 "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}"
                 "th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}"
                 "figcaption{color:#555;font-size:13px}.verdict{font-size:1.15em;padding:.6em;"
                 "background:#fff6e0;border-left:4px solid #e0a000}</style></head><body>",
                 f"<h1>{html.escape(title)}</h1>", intro_md]
        for head, body in sections:
            parts.append(f"<h2>{html.escape(head)}</h2>{body}")
        for file, ftitle, cap in self.figures:
            data = base64.b64encode((self.tmp / file).read_bytes()).decode()
            parts.append(f"<figure><h3>{html.escape(ftitle)}</h3><img src='data:image/png;base64,{data}'>"
                         f"<figcaption>{html.escape(cap)}</figcaption></figure>")
        parts.append("</body></html>")
        (self.tmp / "index.html").write_text("\n".join(parts))

    def commit(self, latest: bool = True) -> Path:
        final = self.root / self.run_id
        if final.exists():
            old = self.root / f".old-{self.run_id}-{os.getpid()}"
            final.rename(old)
            self.tmp.rename(final)
            shutil.rmtree(old)
        else:
            self.tmp.rename(final)
        if latest:
            link = self.root / "latest"
            tmp_link = self.root / f".latest-{os.getpid()}"
            if tmp_link.is_symlink() or tmp_link.exists():
                tmp_link.unlink()
            tmp_link.symlink_to(self.run_id)
            if link.exists() and not link.is_symlink():
                shutil.rmtree(link)
            os.replace(tmp_link, link)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def df_to_html(df: pd.DataFrame, floatfmt: str = "{:.4g}") -> str:
    return df.to_html(index=False, border=0, float_format=lambda v: floatfmt.format(v))


def df_to_markdown(df: pd.DataFrame, floatfmt: str = "{:.4g}") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        cells = [floatfmt.format(v) if isinstance(v, float) else str(v) for v in r.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
