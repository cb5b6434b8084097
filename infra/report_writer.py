"""Report directory I/O shared by every report: atomic writes of tables (CSV), JSON with a
schema version, the page (`infra.report_page`: self-contained HTML with the PNG plots
embedded, and summary.md in the same order), and the `reports/latest` pointer."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from infra.report_page import FigureStore, Page, render_html, render_markdown

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ReportTarget:
    """Where a run's report goes, one value through the run: <out_dir>/<run_id>."""
    out_dir: str | Path | None = "reports"   # None: no report is written
    run_id: str | None = None                # None: the run names it (from the time)


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
        """CSV; `gzip` for the big per-row tables (pandas reads .csv.gz transparently), with no
        time in its header, so the same table is the same bytes (a regenerated report that did
        not change does not show as changed)."""
        if gzip:
            df.to_csv(self.tmp / f"{name}.csv.gz", index=False, compression={"method": "gzip", "mtime": 0})
        else:
            df.to_csv(self.tmp / f"{name}.csv", index=False)

    def json(self, name: str, obj) -> None:
        payload = {"schema_version": SCHEMA_VERSION, **obj}
        (self.tmp / f"{name}.json").write_text(json.dumps(payload, indent=2, default=_jsonable))

    def figure(self, fig, name: str, title: str, caption: str = "") -> None:
        fig.savefig(self.tmp / f"{name}.png", dpi=110, bbox_inches="tight")
        self.figures.append((f"{name}.png", title, caption))

    def page(self, page: Page) -> None:
        """index.html (self-contained) and summary.md of one `Page`, figures placed where
        the page says (unplaced ones under "More plots")."""
        store = FigureStore(self.tmp, self.figures)
        (self.tmp / "index.html").write_text(render_html(page, store))
        (self.tmp / "summary.md").write_text(render_markdown(page, store))

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


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
