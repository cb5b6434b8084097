"""The report page layout (infra.report_page): numbers at 3 significant figures, long
tables folded, cells coloured by their ratio to a floor, the finding and its plots before
the evidence, the manifest last; and, where Debian's chromium is installed, the committed
example reports rendered in a real browser at 1400 px: no page wider than the viewport,
an image on the first screen."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from infra.report_page import FOLD_ROWS, Page, Section, Table, fmt, table_html  # noqa: E402
from infra.report_writer import ReportWriter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, text", [
    (0.0009108214, "0.000911"), (5.157e-06, "5.16e-06"), (-0.0004761, "-0.000476"), (12345.678, "1.23e+04"),
    (1.0, "1"), (0.0, "0"), (25, "25"), (np.int64(7), "7"), (float("nan"), "–"), (None, "–"),
    (True, "yes"), (np.bool_(False), "no"), (float("inf"), "∞"), ("engine", "engine"), (0.98765, "0.988"),
])
def test_numbers_at_three_significant_figures(value, text):
    assert fmt(value) == text


def test_long_tables_fold_short_ones_do_not_and_ratios_colour_cells():
    short = pd.DataFrame({"arm": ["a", "b"], "kld": [0.5, 2.0]})
    html = table_html(Table(short, ratio=pd.DataFrame({"kld": [0.5, 12.0]})))
    assert "<details>" not in html and "class='scroll'" in html
    cells = re.findall(r"<td([^>]*)>([^<]*)</td>", html)
    assert cells[1] == (" title='0.5'", "0.5")                 # below its floor: not coloured
    assert "r3" in cells[3][0] and cells[3][1] == "2"         # 12x its floor: darkest
    assert "class='t'" in cells[0][0]                           # text left-aligned
    long = pd.DataFrame({"i": range(FOLD_ROWS + 1)})
    folded = table_html(Table(long, summary="16 cells"))
    assert folded.startswith("<details><summary>16 cells</summary>")
    assert "<details>" not in table_html(Table(long, fold=False))


def _page_with_figures(tmp_path):
    w = ReportWriter(tmp_path, "r")
    for stem in ("lead", "evidence", "extra"):
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([0, 1], [0, 1])
        w.figure(fig, stem, f"title {stem}", f"caption {stem}")
        plt.close(fig)
    page = Page("T", "compared `a` vs `b`", ["first finding", "second line"], ["lead"],
                Table(pd.DataFrame({"toggle": ["x"], "x_floor": [4.0]})), ["fidelity ab --long"],
                [Section("Evidence", "why", [Table(pd.DataFrame({"v": [1.23456]}))], ["evidence"])],
                {"settings": {"seed": 0}})
    w.page(page)
    return w.commit(latest=False)


def test_page_order_finding_first_manifest_last(tmp_path):
    d = _page_with_figures(tmp_path)
    html = (d / "index.html").read_text()
    order = [html.index(s) for s in ("compared <code>a</code>", "first finding", "title lead", "Suspects",
                                     "fidelity ab --long", "Evidence", "title evidence", "More plots",
                                     "title extra", "<details><summary>manifest")]
    assert order == sorted(order)
    assert html.count("data:image/png;base64,") == 3
    md = (d / "summary.md").read_text()
    order = [md.index(s) for s in ("compared `a`", "**Verdict.** first finding", "![title lead](lead.png)",
                                   "## Suspects", "## What to run next", "## Evidence", "| 1.23 |",
                                   "![title evidence](evidence.png)", "## More plots", "manifest.json")]
    assert order == sorted(order)


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


PROBE = ("<script>window.addEventListener('load',()=>{const i=document.querySelector('img');"
         "document.body.setAttribute('data-probe',JSON.stringify({width:document.documentElement.scrollWidth,"
         "img:i?i.getBoundingClientRect().top:null}));});</script>")


def render_probe(page: Path, width=1400, height=900) -> dict:
    """Open `page` in headless Chromium and read back the page's scroll width and where the
    first image starts (a script added to a copy of the page writes them into the DOM)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.html"
        probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
        out = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}", "--dump-dom",
             probe.as_uri()], capture_output=True, text=True, timeout=300).stdout
    m = re.search(r'data-probe="([^"]*)"', out)
    assert m, "chromium rendered no probe result"
    return json.loads(m.group(1).replace("&quot;", '"'))


@pytest.mark.skipif(not _chromium(), reason="Debian's chromium is not installed")
@pytest.mark.parametrize("report", ["reports/example", "reports/needle/example", "reports/llamacpp-variants"])
def test_example_report_fits_the_screen_with_a_picture_on_it(report):
    got = render_probe(ROOT / report / "index.html")
    assert got["width"] <= 1400, f"{report} is {got['width']} px wide at a 1400 px viewport"
    assert got["img"] is not None and got["img"] < 900, f"{report}: first image at {got['img']} px"
