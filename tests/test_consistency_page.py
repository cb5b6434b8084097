"""The consistency page as a reader opens it (issue 38), built from a real `fidelity serve`
with a planted restore bug (restore_window_one_off, 64-token pages; one 200-token probe,
4 greedy tokens): one headline sentence naming the arm, how many prefix-cache conditions,
the KL and its floor; Suspects with the flagged conditions first; every suggested command
accepted by the real CLI; no Python list repr in a cell; the prefix plot drawing every
flagged prefix condition, the ones with no prefix length (full hit, multi-turn) on their
own panel. And the chunk family's sentence quoting what its flag compares (the means of
the windows after and before a boundary), never a flagged value under a quoted floor."""
import html
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fidelity.consistency.client import LiveArm
from fidelity.consistency.judge import condition_table, verdict_lines
from fidelity.consistency.prefix import PrefixPlan
from fidelity.consistency.plots import prefix_figure
from fidelity.consistency.report import headline, suspects
from fidelity.consistency.run import ConsistencySettings, run_consistency
from fidelity.kld.endpoint import Endpoint
from fidelity.weights.target import load_target
from infra.http import RetryPolicy

from needle_util import served
from test_report_pages import REPR, _cells, check_command, suggested

TARGET = load_target(None)
FAST = RetryPolicy(retries=4, timeout=120.0, backoff=0.05)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpage")
    with served("golden", extra=("--arm", "golden=golden", "--arm", "window=restore_window_one_off",
                                 "--page-size", "64")) as (url,):
        arms = [LiveArm(Endpoint(n, url, None, n, FAST, TARGET.tokenizer)) for n in ("golden", "window")]
        yield run_consistency(arms, TARGET, ConsistencySettings(("prefix",), PrefixPlan(length=200, probes=1,
                                                                                       max_tokens=4)),
                              tmp, "p", progress=lambda m: None)


def _first_table(doc: str) -> pd.DataFrame:
    """The first <table> in `doc` as the reader sees its text (header row, body rows)."""
    t = re.search(r"<table>(.*?)</table>", doc, re.S).group(1)
    text = lambda c: html.unescape(re.sub(r"<[^>]+>", "", c)).strip()         # noqa: E731
    head = [text(c) for c in re.findall(r"<th>(.*?)</th>", t, re.S)]
    rows = [[text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in re.findall(r"<tr>(.*?)</tr>", t.split("</thead>", 1)[1], re.S)]
    return pd.DataFrame(rows, columns=head)


def _doc(result) -> str:
    return open(f"{result['path']}/index.html").read()


def test_headline_suspects_and_next_steps(result):
    doc = _doc(result)
    head = html.unescape(re.sub(r"<[^>]+>", "", re.search(r"class='headline'>(.*?)</p>", doc, re.S).group(1)))
    t = result["conditions"]
    n = int(((t.arm == "window") & (t.condition != "cold-again")).sum())
    k = int(t[t.arm == "window"].flagged.sum())
    assert head.startswith("window changes its replies") and f"under {k} of {n} prefix-cache conditions" in head
    assert "KL up to" in head and "vs 0 (bit-identical) between two cold starts" in head, head
    assert doc.index("class='headline'") < doc.index("<h2>Suspects</h2>") < doc.index("<h2>What to run next</h2>")
    # Suspects: the flagged conditions only, strongest (largest KL) first
    sus = _first_table(doc[doc.index("<h2>Suspects</h2>"):])
    assert list(sus.arm) == ["window"] * k
    flagged = t[t.flagged].sort_values("kl_max", ascending=False)
    assert sus.condition.iloc[0] == flagged.condition.iloc[0]
    assert set(sus.condition) == set(flagged.condition)
    # the prefix table: folded, flagged rows first, the explanation beside the names
    table = doc[doc.index("Prefix cache: a hit"):]
    assert re.search(r"<details><summary>\d+ conditions \(\d+ flagged, listed first\)</summary>", table)
    rows = _first_table(table)
    assert list(rows.columns[:4]) == ["arm", "condition", "flagged", "why"]
    assert list(rows.flagged[:k]) == ["yes"] * k and "yes" not in list(rows.flagged[k:])
    cmds = suggested(Path(result["path"]))
    assert cmds and all("--endpoint window=" in c and "--families prefix" in c for c in cmds)
    for c in cmds:
        check_command(c)
    bad = [c for c in _cells(Path(result["path"])) if REPR.search(c)]
    assert not bad, bad[:5]


def test_prefix_plot_draws_every_flagged_condition(result):
    t = result["conditions"]
    fig = prefix_figure(t)
    pre = t[(t.family == "prefix") & (t.condition != "cold-again")]
    assert set(zip(pre.arm, pre.condition)) == set(fig.drawn)           # flagged or not, every one
    assert {c for a, c in fig.drawn if fig.drawn[(a, c)] == 1} == {"full-hit", "multi-turn"}
    assert all(p == 0 for (a, c), p in fig.drawn.items() if c.startswith("hit@"))
    # the non-prefix panel has no line joining its points
    assert all(ln.get_linestyle() in ("None", "none", "") for ln in fig.axes[1].lines)
    assert any(c in ("full-hit", "multi-turn") for c in t[t.flagged].condition)


def _chunk_rows(after, before):
    rows = []
    for cond, cls, kl in (("before@128", "chunk-before", before), ("after@128", "chunk-boundary", after)):
        for probe, w in enumerate(kl):
            rows.append({"arm": "bug", "family": "chunk", "probe": probe, "condition": cond, "class": cls,
                         "shared": 128, "cached": None, "tokens": [], "bitwise": False, "kl_window": w,
                         "first_diff": None, "kl_first": w[0], "kl_max": max(w)})
    return pd.DataFrame(rows)


def test_chunk_sentence_quotes_what_it_compares():
    """After the boundary the mean is 5x the mean before it while one position before it
    holds the largest KL: the line quotes the two means, not a floor above its value."""
    rng = np.random.default_rng(0)
    before = [list(rng.uniform(1e-4, 2e-4, 16)) for _ in range(4)]
    before[0][3] = 0.2                                        # one spike before the boundary
    after = [list(rng.uniform(0.015, 0.025, 16)) for _ in range(4)]
    t = condition_table(_chunk_rows(after, before))
    assert t.set_index("condition").loc["after@128", "flagged"]
    line = verdict_lines(t)[0]
    m = re.search(r"mean KL ([\d.e-]+) just after it vs ([\d.e-]+) just before it", line)
    assert m and float(m.group(1)) > float(m.group(2)), line
    assert "before the boundaries: KL up to" not in line, line
    sus = suspects(t, pd.DataFrame())
    assert np.isnan(sus.floor.iloc[0])             # no max-before quoted as its floor; the means in `why`
    head = headline(t, pd.DataFrame(), sus)
    assert head.startswith("`bug` jumps in KL after 1 of 1 prefill chunk boundaries, most at token 128: mean KL")


def test_chunk_floor_words_quote_the_positions_before_the_first_boundary():
    """An arm that differs evenly from the reference after its first boundary (no jump at
    either): the line quotes the KL before the first boundary, not a later window that
    already follows a boundary (the `stale`-class disagreement, issue 49)."""
    rng = np.random.default_rng(1)
    early = [list(rng.uniform(1e-5, 2e-5, 16)) for _ in range(4)]
    late = [list(rng.uniform(0.1, 0.2, 16)) for _ in range(4)]
    rows = []
    for cond, cls, shared, kl in (("before@128", "floor", 128, early), ("after@128", "chunk-boundary", 128, early),
                                  ("before@256", "floor", 256, late), ("after@256", "chunk-boundary", 256, late)):
        for probe, w in enumerate(kl):
            rows.append({"arm": "even", "family": "chunk", "probe": probe, "condition": cond, "class": cls,
                         "shared": shared, "cached": None, "tokens": [], "bitwise": False, "kl_window": w,
                         "first_diff": None, "kl_first": w[0], "kl_max": max(w)})
    t = condition_table(pd.DataFrame(rows))
    assert not t.flagged.any()
    line = verdict_lines(t)[0]
    m = re.search(r"before the first boundary: KL up to ([\d.e-]+); 2 conditions compared", line)
    assert m and float(m.group(1)) < 1e-4, line


def test_spec_figure_marks_first_differences_and_off_top1_tokens():
    """One panel per arm; the off-top-1 token is drawn at its step, the floor as a line."""
    from fidelity.consistency.plots import spec_figure
    rows = []
    for arm, kl, off in (("golden-spec", [0.0] * 6, []), ("lossy", [0, 0, 0.3, 0.5, 0.2, 0.1], [2])):
        for probe in (0, 1):
            rows.append({"family": "spec", "condition": "greedy", "arm": arm, "baseline": "base", "probe": probe,
                         "kl": kl, "first_lp_diff": 2 if off else None, "first_diff": 2 if off else None,
                         "off_top1": off, "injected": [], "floor_kl_max": 0.0})
    rows.append({"family": "prefix", "condition": "cold-again", "arm": "x"})
    fig = spec_figure(pd.DataFrame(rows))
    assert len(fig.axes) == 2 and fig.axes[1].get_title() == "lossy vs base"
    crosses = [c for c in fig.axes[1].collections if c.get_offsets().shape[0] and c.get_facecolor().any()
               and tuple(c.get_offsets()[0]) == (2.0, 0.3)]
    assert crosses                                             # the off-top-1 token at step 2
    assert not [c for c in fig.axes[0].collections]            # lossless: nothing marked
    assert spec_figure(pd.DataFrame(rows[-1:])) is None
