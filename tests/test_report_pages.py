"""Every report a person reads, generated small and read the way a reader would: no Python
list repr in a table cell, no empty place after "at", every command under "What to run
next" accepted by the real `fidelity` parser and its arms by the arm parser that command
uses, every link of the engines index resolving to a file, and (with Debian's chromium)
no page wider than a 1400 px screen. Pages: ab (a bug added to the engine; a bug inside a
two-toggle base with the default design; the committed example re-rendered), needle and
kld (in-process), chat-check (a server rendering with DeepSeek-V3.2's template), engines
(its index over those kld and needle reports, one arm flagged only by consistency),
weights-diff. Consistency pages need live servers per family (tests/test_consistency.py)
and are not built here.

Then the ab page's parts: the one-sentence headline, Suspects that say which kind of
finding a row is, plots that draw every requested arm or say why not, floors visible,
styles distinct past 10 lines, exact zeros shown as 0, integer ticks, no backticks."""
from __future__ import annotations

import html
import json
import re
import shlex
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from fidelity.ab import plots  # noqa: E402
from fidelity.ab.design import ABSettings, arm_sets, vs_pairs  # noqa: E402
from fidelity.ab.report import plotted_arms, rerender  # noqa: E402
from fidelity.ab.run import ReportTarget, RunSite, run_ab  # noqa: E402
from fidelity.design.arms import parse_arm  # noqa: E402
from fidelity.cli import build_parser, main, name_value_pairs  # noqa: E402
from fidelity.commands.needle import _named  # noqa: E402
from infra.plot_style import arm_styles  # noqa: E402
from reference_model import random_weights, tiny  # noqa: E402

from needle_util import kld_exit, served  # noqa: E402
from test_report_page import _chromium, render_probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Q = ["--quiet", "--threads", "1"]


# ---- building the pages -------------------------------------------------------------------
def _ab(weights, out, run_id, **kw):
    s = ABSettings.of(lengths=(160,), prompts_per_length=3, decode_steps=2, n_boot=200, shapley_top=0, **kw)
    return run_ab(weights, s, ReportTarget(out, run_id), RunSite())


ENGINES_SPEC = """
[run]
baseline = "golden"
tasks = ["kld", "needle", "consistency"]
out = "{out}"
[engines.fs]
kind = "fidelity"
port = 18999
[[arms]]
name = "golden"
engine = "fs"
toggles = "golden"
[[arms]]
name = "engine"
engine = "fs"
toggles = "engine"
factors = ["engine"]
[[arms]]
name = "bug"
engine = "fs"
toggles = "engine,routed_scaling_double"
factors = ["bug"]
"""
# what a consistency task leaves in state.json for an arm one condition of which is flagged,
# in the words that read as fine (issue 38)
QUIET_WORDS = ("`bug` (chunk): no serving condition changes its replies (before the first boundary: KL up to 0.2; "
               "1 conditions).")


def _engines_index(root: Path) -> Path:
    """The engines index over the kld and needle reports already in `root`, as
    fidelity.engines.run.report builds it, with a consistency result for two arms."""
    from fidelity.engines.page import engines_page, write_index
    from fidelity.engines.run import State
    from fidelity.engines.spec import load_spec
    from needle.results import latest, read_rows
    from needle.tables import by_arm
    (root / "spec.toml").write_text(ENGINES_SPEC.format(out=root))
    spec = load_spec(root / "spec.toml")
    state = State(root / "state.json")
    for a in spec.arms:
        state.arm(a.name).update(done=["kld", "needle", "consistency"], ready_s=1.5)
        (root / "logs").mkdir(exist_ok=True)
        (root / "logs" / f"{a.name}.log").write_text("")
    for name, flagged in (("engine", []), ("bug", ["chunk/after@128"])):
        (root / "consistency" / name).mkdir(parents=True)
        (root / "consistency" / name / "index.html").write_text("<html></html>")
        state.arm(name)["consistency"] = {"verdict": [QUIET_WORDS.replace("`bug`", f"`{name}`")],
                                          "path": f"consistency/{name}", "conditions": 3, "flagged": flagged}
    state.save()
    kld = root / "kld" / "k"
    _, rows = read_rows(root / "needle" / "results.jsonl")
    out = {"root": root, "kld": kld, "verdict": json.loads((kld / "manifest.json").read_text())["verdict"],
           "needle": root / "needle" / "n", "recall": by_arm(latest(rows)),
           "consistency": {a: state.arm(a)["consistency"] for a in ("engine", "bug")}}
    write_index(root, engines_page(spec, state, out), out)
    return root


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """name -> report directory (index.html, summary.md)."""
    tmp = tmp_path_factory.mktemp("pages")
    w = random_weights(tiny(), 0)
    out = {"ab-added": _ab(w, tmp / "ab", "added", arms=["engine", "engine,routed_scaling_double"])["path"],
           "ab-inside": _ab(w, tmp / "ab", "inside", base="wo_a_fp8,routed_scaling_double")["path"],
           "ab-example": rerender(ROOT / "reports" / "example", tmp / "ab", "example")}
    eng = tmp / "engines"
    assert main(["kld", "--arm", "golden=golden", "--arm", "engine=engine",
                 "--arm", "bug=engine,routed_scaling_double", "--lengths", "250", "--depths", "50",
                 "--reps", "3", "--decode-steps", "2", "--n-boot", "100", "--out", str(eng), "--run-id", "k", *Q]) == 1
    assert main(["needle", "--arm", "golden", "--arm", "bug=engine,routed_scaling_double", "--lengths", "400",
                 "--depths", "50", "--reps", "2", "--max-tokens", "8", "--out", str(eng), "--run-id", "n", *Q]) == 0
    out.update(kld=eng / "kld" / "k", needle=eng / "needle" / "n", engines=_engines_index(eng))
    with served("chat_template_v32") as (url,):
        main(["chat-check", "--endpoint", url, "--engine-profile", "sglang", "--out", str(tmp), "--run-id", "c",
              "--quiet"])
    out["chat-check"] = tmp / "chat-check" / "c"
    out["weights-diff"] = _weights_diff(tmp)
    return {name: Path(d) for name, d in out.items()}


def _weights_diff(tmp: Path) -> Path:
    from reference_model.checkpoint import save_checkpoint
    from reference_model.weights import InMemoryWeights
    w = random_weights(tiny(), 11)
    name = "layers.3.ffn.experts.2.w1.weight"
    changed = InMemoryWeights(w.cfg, {**w.tensors, name: w.tensors[name].flip(0)})
    a, b = save_checkpoint(w, tmp / "wa"), save_checkpoint(changed, tmp / "wb")
    assert main(["weights-diff", str(a), str(b), "--out", str(tmp), "--run-id", "w", "--quiet"]) == 1
    return tmp / "weights-diff" / "w"


PAGES = ["ab-added", "ab-inside", "ab-example", "needle", "kld", "chat-check", "engines", "weights-diff"]


# ---- reading them ------------------------------------------------------------------------
# a Python repr of a list, tuple, set or dict: ['a'], ("a", ...), {'k': ...}, [] or [250, 511]
REPR = re.compile(r"[\[\(\{]\s*['\"]|['\"]\s*[\]\)\}]|^\[\]$|^\[\d[\d.,\s-]*\]$|^\{\}$|^\(\)$")
EMPTY_AT = re.compile(r"\bat\s+\(|\bat\s*[,;:]|\bat\s*$", re.M)


def _cells(page: Path) -> list[str]:
    """Every table cell of the page, HTML and Markdown, as the reader sees its text."""
    doc = (page / "index.html").read_text()
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", doc, re.S)]
    for line in (page / "summary.md").read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells += [c.strip() for c in line.strip().strip("|").split(" | ")]
    return cells


def _visible_text(page: Path) -> str:
    doc = re.sub(r"<(style|pre)[^>]*>.*?</\1>", " ", (page / "index.html").read_text(), flags=re.S)
    doc = re.sub(r"<img[^>]*>", " ", doc)
    return html.unescape(re.sub(r"<[^>]+>", " ", doc))


def suggested(page: Path) -> list[str]:
    """The commands under "What to run next" (comment-only lines left out)."""
    m = re.search(r"<h2>What to run next</h2>\s*<pre>(.*?)</pre>", (page / "index.html").read_text(), re.S)
    lines = html.unescape(m.group(1)).splitlines() if m else []
    return [x for x in lines if x.strip() and not x.strip().startswith("#")]


def _check_ab(a) -> None:
    labels, _, _ = arm_sets(ABSettings.of(arms=a.arms, base=a.base, vs=a.vs, schedule=a.schedule))
    vs_pairs(a.vs, labels)


def _check_needle(a) -> None:
    for spec in a.arm or []:
        parse_arm(_named(spec, spec)[1])
    name_value_pairs(a.endpoint, "--endpoint", "URL")


def _check_kld(a) -> None:
    names = [n for n, _ in name_value_pairs(a.endpoint, "--endpoint", "URL")]
    for n, spec in name_value_pairs(a.inprocess, "--arm", "ARM"):
        parse_arm(spec)
        names.append(n)
    assert a.baseline is None or a.baseline in names, f"--baseline {a.baseline} is not an arm"


def _check_engines(a) -> None:
    assert Path(a.spec).exists(), f"no spec {a.spec}"


SEMANTICS = {"ab": _check_ab, "needle": _check_needle, "kld": _check_kld, "engines": _check_engines}


def check_command(cmd: str) -> None:
    """`cmd` parses with `fidelity`'s own argparse parser (nothing runs), and the arms it
    names parse as the command would parse them; AssertionError saying why otherwise."""
    argv = shlex.split(cmd, comments=True)
    assert argv and argv[0] == "fidelity", f"not a fidelity command: {cmd}"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"the CLI rejects: {cmd}") from None
    try:
        SEMANTICS.get(args.command, lambda a: None)(args)
    except ValueError as e:
        raise AssertionError(f"{cmd}: {e}") from None


# ---- every page ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", PAGES)
def test_page_reads_cleanly(pages, name):
    page = pages[name]
    bad = [c for c in _cells(page) if REPR.search(c)]
    assert not bad, f"{name}: Python reprs in table cells: {bad[:5]}"
    text = _visible_text(page)
    empty = [text[max(0, m.start() - 60):m.end() + 20] for m in EMPTY_AT.finditer(text)]
    assert not empty, f"{name}: an empty place after 'at': {empty[:3]}"
    assert "`" not in "".join(re.findall(r"<td[^>]*>(.*?)</td>", (page / "index.html").read_text(), re.S))


@pytest.mark.parametrize("name", PAGES)
def test_headline_numbers_are_in_the_pages_tables(pages, name):
    """One number, one place (test_page_numbers.py's rule) on every kind of page, the
    engines page and kld's included."""
    from test_page_numbers import headline, missing_numbers
    page = (pages[name] / "summary.md").read_text()
    assert not missing_numbers(page), f"{name}: headline numbers in no table: {missing_numbers(page)}\n" \
                                      f"headline: {headline(page)}"


@pytest.mark.parametrize("name", PAGES)
def test_every_suggested_command_parses(pages, name):
    for cmd in suggested(pages[name]):
        check_command(cmd)


def test_the_command_check_can_fail():
    """The spellings issue 38 found on pages: each is refused by the check above."""
    for cmd in ("fidelity ab --arm engine --arm engine-routed_scaling_double --vs engine",
                "fidelity ab --arm engine --vs wo_a_fp8",
                "fidelity kld --arm golden=golden --arm engine-bug=engine-bug --exact",
                "fidelity needle --arm golden=golden --arm 'x=no_such_toggle'",
                "fidelity ab --no-such-option"):
        with pytest.raises(AssertionError):
            check_command(cmd)


def test_the_ab_pages_suggest_real_work(pages):
    """A bug added to the engine is run alone and on it; a bug inside a base is taken out of
    it with the base's own spelling; each page suggests needle and kld on the culprit."""
    added, inside = suggested(pages["ab-added"]), suggested(pages["ab-inside"])
    assert "--arm routed_scaling_double --arm engine --arm engine,routed_scaling_double --vs engine" in added[0]
    assert "--arm wo_a_fp8,routed_scaling_double --arm wo_a_fp8 --vs wo_a_fp8,routed_scaling_double" in inside[0]
    for cmds in (added, inside):
        assert [c.split()[1] for c in cmds] == ["ab", "needle", "kld"]


def test_engines_index_links_and_one_line_per_arm(pages):
    root = pages["engines"]
    doc = (root / "index.html").read_text()
    hrefs = re.findall(r"<a href='([^']+)'>", doc)
    assert {"kld/k/index.html", "needle/n/index.html", "consistency/bug/index.html", "logs/bug.log"} <= set(hrefs)
    missing = [h for h in hrefs if h != "launch.sh" and not (root / h).exists()]    # launch.sh: by engines run
    assert not missing, missing
    block = (root / "summary.md").read_text().split("## Each arm in one line", 1)[1].split("\n## ", 1)[0]
    rows = {r.split(" | ")[0].strip("| "): r for r in block.splitlines() if r.startswith("| ")}
    assert rows["bug"].startswith("| bug | **flagged**: ") and "consistency: chunk/after@128" in rows["bug"]
    assert "**1 of 3 conditions flagged**" in rows["bug"]         # never "nothing flagged" beside a flag
    assert "nothing flagged in 3 conditions" in rows["engine"]
    assert rows["golden"].startswith("| golden | baseline |")
    head = re.search(r"<p class='headline'>(.*?)</p>", doc).group(1)
    v = json.loads((root / "kld" / "k" / "manifest.json").read_text())["verdict"]
    assert v["culprit"] in head


@pytest.mark.skipif(not _chromium(), reason="Debian's chromium is not installed")
@pytest.mark.parametrize("name", ["ab-added", "chat-check", "engines"])
def test_wide_tables_wrap_within_the_screen(pages, name):
    got = render_probe(pages[name] / "index.html")
    assert got["width"] <= 1400, f"{name} is {got['width']} px wide at a 1400 px viewport"


# ---- the ab page's parts -------------------------------------------------------------------
def _headline(page: Path) -> str:
    return html.unescape(re.search(r"<p class='headline'>(.*?)</p>", (page / "index.html").read_text()).group(1))


def _suspects(page: Path) -> pd.DataFrame:
    md = (page / "summary.md").read_text()
    block = md.split("## Suspects", 1)[1].split("\n## ", 1)[0]
    rows = [r.strip().strip("|").split(" | ") for r in block.splitlines() if r.startswith("| ")]
    return pd.DataFrame(rows[1:], columns=[c.strip() for c in rows[0]])


def test_headline_first_with_culprit_place_and_floor(pages):
    page = pages["ab-added"]
    m = json.loads((page / "manifest.json").read_text())
    c = m["verdict"]["named"][0]
    head = _headline(page)
    assert head.startswith(c["toggle"]) and f"{c['value']:.3g}" in head and "× the highest floor" in head
    doc = (page / "index.html").read_text()
    assert doc.index("class='headline'") < doc.index("<img") < doc.index("<h2>Suspects") \
        < doc.index("<h2>What to run next")
    example = pages["ab-example"]
    assert not json.loads((example / "manifest.json").read_text())["verdict"]["named"]
    assert _headline(example).startswith("Nothing changes the outcome beyond its floors; inside, ")


def test_suspects_say_which_kind_of_finding(pages):
    """Under a verdict that names nothing, no suspect reads as named; a named culprit leads
    with its outcome row (the one the verdict quotes)."""
    s = _suspects(pages["ab-example"])
    assert len(s) and not s.finding.str.startswith("outcome").any()
    from fidelity.verdict.board import BELOW_TAIL, MECHANISM_ONLY, NEITHER
    assert set(s.finding) <= {MECHANISM_ONLY, NEITHER, BELOW_TAIL} and "named" not in s.columns
    tail = s[s.method == "tail"]                     # one prompt's multiple: never "below floors" above 1x
    assert not ((tail.finding == NEITHER) & (pd.to_numeric(tail.x_floor, errors="coerce") > 1)).any()
    s = _suspects(pages["ab-added"])
    assert s.finding.iloc[0].startswith("outcome (named)") and s.signal.iloc[0] not in (
        "topk_loss", "needle_lost", "expert_disagree")


def test_default_design_plots_say_which_arms_they_leave_out(pages):
    """The default design draws its singles and the base; the leave-one-out arms and the
    factorial stage are named in the caption instead."""
    page = pages["ab-example"]
    m = json.loads((page / "manifest.json").read_text())["manifest"]
    sets = {a: frozenset(t) for a, t in m["arms"].items()}
    drawn, left = plotted_arms(m, sets)
    assert "engine" in drawn and all(a in drawn for a in sets if len(sets[a]) == 1)
    assert sorted(drawn + [a for v in left.values() for a in v]) == sorted(sets)
    caption = (page / "summary.md").read_text().split("![Drift vs layer]", 1)[1].split("\n\n")[1]
    assert "Not drawn" in caption and "leave-one-out arms of the base" in caption


@pytest.fixture(scope="module")
def added(tmp_path_factory):
    return _ab(random_weights(tiny(), 0), None, None, arms=["engine", "engine,routed_scaling_double"])


FLOORS = ["floor:exact", "floor:fp32-accum", "floor:tie-order"]


def _labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_every_requested_arm_is_drawn_or_said(added):
    """engine and engine + bug (the run's --arm) in drift, top-k and decode plots, each drawn
    or named with the reason in fig.absent; floors drawn hollow, above the arms."""
    arms = FLOORS + ["engine", "engine,routed_scaling_double"]
    figs = [plots.drift_vs_layer(added["drift"], "floor:exact", arms, floors=FLOORS),
            plots.topk_recall_vs_position(added["drift"], arms, floors=FLOORS),
            plots.decode_drift(added["kld"], arms, floors=FLOORS)]
    for fig in figs:
        shown = {lab.split(" (")[0] for lab in _labels(fig)}
        assert set(arms) <= shown | set(fig.absent), (set(arms) - shown, fig.absent)
        lines = {ln.get_label().split(" (")[0]: ln for ax in fig.axes for ln in ax.get_lines()}
        for f in set(FLOORS) & set(lines):
            assert lines[f].get_markerfacecolor() == "white" and lines[f].get_zorder() > lines["engine"].get_zorder()
    plt.close("all")


def test_no_backticks_and_integer_ticks(added):
    figs = [plots.drift_vs_layer(added["drift"], "floor:exact", FLOORS + ["engine"], floors=FLOORS),
            plots.decode_drift(added["kld"], FLOORS + ["engine"], floors=FLOORS),
            plots.toggle_layer_heatmap(added["drift"], ["engine"])]
    for fig in figs:
        for ax in fig.axes:
            assert "`" not in ax.get_xlabel() + ax.get_ylabel() + ax.get_title()
    for fig in figs[:2]:
        ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close("all")


def test_styles_stay_distinct_past_ten_lines():
    arms = [f"a{i}" for i in range(25)] + FLOORS
    st = arm_styles(arms, FLOORS)
    keys = [(str(s["color"]), str(s["ls"]), s["marker"]) for s in st.values()]
    assert len(set(keys)) == len(keys)
    assert all(st[f]["zorder"] > st["a0"]["zorder"] and st[f]["mfc"] == "white" for f in FLOORS)


def test_overlapping_lines_are_marked():
    fig, ax = plt.subplots()
    s = pd.Series([0.9, 0.8], index=[0, 1])
    plots._lines(ax, {"a": s, "b": s.copy(), "c": s + 1e-4, "d": s - 0.5})
    assert [ln.get_label() for ln in ax.get_lines()] == ["a", "b (= a)", "c (≈ a)", "d"]
    plt.close(fig)


def test_heatmap_shows_exact_zeros_as_zero():
    """An arm identical to golden at a layer is written 0 and left out of the log colour
    scale, so the scale spans the non-zero values (not 1e-12 .. max)."""
    rows = [{"arm": a, "layer": layer, "rel_l2": v, "tap": "out", "phase": "prefill", "bucket": "all"}
            for a, vals in {"zero": [0.0, 0.0, 0.0], "some": [0.0, 1e-3, 1e-1]}.items()
            for layer, v in enumerate(vals)]
    fig = plots.toggle_layer_heatmap(pd.DataFrame(rows), ["zero", "some"])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["0", "0", "0", "0", "0.001", "0.1"]
    im = fig.axes[0].images[0]
    assert im.norm.vmin == pytest.approx(1e-3) and im.norm.vmax == pytest.approx(1e-1)
    assert np.ma.getmaskarray(im.get_array())[0].all()              # zeros are not coloured by the scale
    plt.close(fig)


# ---- the shared page -----------------------------------------------------------------------
def test_cells_links_and_headline_of_the_shared_page():
    """Lists and dicts read as words; a long explanation cell wraps (class w) where numbers
    do not; a markup table links; the headline comes first with the verdict folded under it."""
    from infra.report_page import Page, Table, _verdict_html, fmt, table_html
    assert (fmt(["engine"]), fmt(("a", "b")), fmt({"k": 1.23456}), fmt([])) == ("engine", "a, b", "k=1.23", "–")
    why = "the replies change at the second chunk boundary, 4.1x the KL just before it"
    doc = table_html(Table(pd.DataFrame({"kl": [0.5], "why": [why], "link": ["[report](c/index.html)"]}), markup=True))
    cells = re.findall(r"<td([^>]*)>(.*?)</td>", doc)
    assert "w" not in cells[0][0] and "class='t w'" in cells[1][0]
    assert cells[2][1] == "<a href='c/index.html'>report</a>"
    v = _verdict_html(Page("T", "c", ["full one", "full two"], headline="t breaks it"))
    assert v.index("class='headline'>t breaks it") < v.index("<details>") < v.index("<li>full one")
