"""Selection margins in `fidelity kld` (fidelity/kld/margins.py): the implied score
perturbation ε and the fragile flag on hand-worked score rows; and end to end against a
real `fidelity serve` process serving golden and a planted arm that swaps the indexer's
k-th pick for the (k+1)-th: the planted arm shows ε > 0 -- at the first CSA layer exactly
half the gap between golden's k-th and (k+1)-th scores -- and the served golden ε == 0
with margins equal to the in-process golden's, recomputed here by another route."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from fidelity.ab.margins import entry_margin
from fidelity.design.arms import parse_arm
from fidelity.cli import main
from fidelity.scores.dialects import PromptScores
from fidelity.kld.margins import implied_perturbation, is_fragile, margin_rows, margin_summary
from fidelity.design.prompts import grid_prompts
from fidelity.weights.target import load_target
from needle.haystack import needle_entries
from reference_model import Model

from needle_util import kld_exit, served

INF = math.inf
S = [5.0, 4.0, 3.0, 2.0, 1.0, -INF]          # entry 5 not visible; top-2 = {0, 1}


def test_implied_perturbation_by_hand():
    # arm swapped entry 1 (4.0) for entry 2 (3.0): (4 - 3) / 2
    assert implied_perturbation(S, [0, 1], [0, 2]) == 0.5
    # dropped {0, 1} (best 5.0), added {2, 3} (worst 2.0): (5 - 2) / 2
    assert implied_perturbation(S, [0, 1], [2, 3]) == 1.5
    # dropped {1} (4.0), added {0}? no: 0 was kept -- added {3} (2.0): (4 - 2) / 2
    assert implied_perturbation(S, [0, 1], [0, 3]) == 1.0
    # the same picks in another order, with -1 padding: nothing shown
    assert implied_perturbation(S, [0, 1, -1], [1, 0, -1]) == 0.0
    # an added entry the baseline cannot see is no score perturbation: only 1 dropped, 0
    assert implied_perturbation(S, [0, 1], [0, 5]) == 0.0
    # the arm added a better-scored entry than the one it dropped: no bound beyond 0
    assert implied_perturbation([1.0, 2.0, 3.0], [0], [2]) == 0.0


def test_fragile_by_hand():
    # needle entry 1 (4.0) inside top-2: margin = 4 - 3 (best score left out) = 1
    m_in = entry_margin(torch.tensor(S), [1], 2)["margin"]
    assert m_in == 1.0
    # needle entry 3 (2.0) outside: margin = 2 - 4 (lowest score kept) = -2
    m_out = entry_margin(torch.tensor(S), [3], 2)["margin"]
    assert m_out == -2.0
    assert is_fragile(m_in, 0.5) is False          # |1| < 2*0.5 = 1? no (strict)
    assert is_fragile(m_in, 0.51) is True          # |1| < 1.02
    assert is_fragile(m_out, 1.5) is True          # |-2| < 3
    assert is_fragile(m_out, 1.0) is False         # |-2| < 2? no
    assert is_fragile(m_in, 0.0) is False          # no shown perturbation: never fragile
    assert is_fragile(math.nan, 1.0) is None       # no needle entry: no flag


def _scores(n, picks_last, index_scores=None):
    """PromptScores with only what margin_rows reads: n prompt ids, one CSA layer whose
    picks are -1 but at the last position."""
    idx = np.full((n, 1, 3), -1, np.int64)
    idx[n - 1, 0, :len(picks_last)] = picks_last
    return PromptScores(list(range(n)), [], [], [], indexer=idx, index_scores=index_scores)


def test_margin_rows_and_summary_by_hand():
    # 24 tokens, ratio 4: 6 entries visible at position 23; needle token 4 -> entries {1, 2}
    row = np.array([[5.0, 4.0, 3.5, 2.0, 1.0, 0.0]])
    base = _scores(24, [0, 1, 2], row)
    arm = _scores(24, [0, 1, 3])                   # dropped 2 (3.5), added 3 (2.0): ε = 0.75
    got = margin_rows(base, arm, [1], 3, [4], [0, 4])
    # best needle entry is 1 (4.0, rank 2 <= 3): margin = 4 - 2 (best left out) = 2 < 2*0.75? no
    assert got == [{"layer": 1, "golden_margin": 2.0, "eps": 0.75, "fragile": False}]
    # without a needle: ε only
    r = margin_rows(base, arm, [1], 3, [], [0, 4])[0]
    assert r["eps"] == 0.75 and math.isnan(r["golden_margin"]) and r["fragile"] is None
    # an endpoint baseline keeps no scores: nothing to say
    assert margin_rows(_scores(24, [0, 1, 2]), arm, [1], 3, [4], [0, 4]) == []
    # over two prompts: medians of margin (2, 0.5) and ε (0.75, 0.25); fragile 1 of 2
    df = pd.DataFrame([{"arm": "a", "prompt": "p", "layer": 1, **got[0]},
                       {"arm": "a", "prompt": "q", "layer": 1, "golden_margin": 0.5, "eps": 0.25,
                        "fragile": True},
                       {"arm": "a", "prompt": "r", "layer": 1, "golden_margin": math.nan, "eps": 0.0,
                        "fragile": None}])
    s = margin_summary(df).iloc[0]
    assert (s.prompts, s.with_margin) == (3, 2)
    assert s.golden_margin_median == 1.25 and s.eps_median == 0.25 and s.eps_max == 0.75
    assert s.fragile == 0.5


def test_capture_taps_keep_one_score_row_per_layer():
    from fidelity.scores.inprocess import CAPTURE_TAPS, LATEST_TAPS, last_score_rows
    from reference_model.taps import Taps
    taps = Taps(CAPTURE_TAPS, latest=LATEST_TAPS)
    taps.put("layers.1.attn.index.last_scores", torch.tensor([[1.0, 2.0]]))       # chunk 1
    taps.put("layers.1.attn.index.last_scores", torch.tensor([[3.0, 4.0, 5.0]]))  # chunk 2
    taps.put("layers.1.attn.index.topk", torch.tensor([[0]]))
    taps.put("layers.1.attn.index.topk", torch.tensor([[1]]))
    assert len(taps.parts("layers.1.attn.index.last_scores")) == 1               # O(entries)
    assert len(taps.parts("layers.1.attn.index.topk")) == 2                      # others untouched
    # layer 3 never had an entry (no tap): a row of -inf, padded to the widest layer
    got = last_score_rows(taps, [1, 3])
    assert got.shape == (2, 3) and got[0].tolist() == [3.0, 4.0, 5.0] and np.isneginf(got[1]).all()


# ---- end to end over a real server ------------------------------------------------------
T = load_target(None)
LENGTHS, DEPTHS = [250, 511], [50.0]

PLUGIN = """
import torch
from kernel_toggles import toggle
@toggle("index_pick_swapped", kernel="index_topk", category="known-bug", wraps=True,
        description="Test arm: the indexer's k-th pick replaced by its (k+1)-th.")
def _swapped(golden, scores, k):
    if k >= scores.shape[-1]:
        return golden.index_topk(scores, k)
    q = golden.index_topk(scores, k + 1)                 # ascending entry order, -1 = none
    sq = scores.gather(-1, q.clamp(min=0)).masked_fill(q < 0, float("-inf"))
    rank = torch.sort(sq, dim=-1, descending=True, stable=True).indices  # golden's tie rule
    keep = torch.cat([rank[:, :k - 1], rank[:, k:]], 1)  # all but the k-th best
    return q.gather(-1, keep.sort(-1).values)
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    plug = tmp_path_factory.mktemp("plugin") / "swapped.py"
    plug.write_text(PLUGIN)
    with served("golden", extra=("--plugin", str(plug), "--arm", "served=golden",
                                 "--arm", "planted=index_pick_swapped")) as (u,):
        yield u


def _golden_last_rows(tokens) -> dict[int, np.ndarray]:
    """Golden's indexer scores at the last position per CSA layer, recorded from the
    index_scores kernel while the last token runs alone after the rest (needle_runner's
    route: another schedule and no taps, unlike the in-process kld scorer)."""
    g = parse_arm("golden").numerics()
    calls = []
    rec = g.with_kernels("rec", index_scores=lambda golden, q, k, w: calls.append(
        golden.index_scores(q, k, w)) or calls[-1])
    cache: dict = {}
    _, st = Model(T.weights, g, weight_cache=cache).extend(tokens[:-1], None, "none")
    Model(T.weights, rec, weight_cache=cache).extend(tokens[-1:], st, "last", phase="prefill")
    csa = T.cfg.indexer_layers()
    assert len(calls) == len(csa)
    return {i: c[-1].double().numpy() for i, c in zip(csa, calls)}


def test_served_arms_margins_and_implied_perturbation(tmp_path, url):
    out = tmp_path / "out"
    rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"served={url}",
               "--endpoint", f"planted={url}", "--lengths", ",".join(map(str, LENGTHS)),
               "--depths", "50", "--decode-steps", "2", "--n-boot", "100", "--no-floors", "--no-twin",
               "--out", str(out), "--run-id", "r", "--quiet"])
    rep = out / "kld" / "r"
    assert rc == kld_exit(rep)
    mg = pd.read_csv(rep / "margins.csv")
    summary = pd.read_csv(rep / "margin_summary.csv")
    csa, k = T.cfg.indexer_layers(), T.cfg.index_topk
    prompts = grid_prompts(T.tokenizer, LENGTHS, DEPTHS, 1, 0)
    assert len(mg) == 2 * len(prompts) * len(csa)
    first = csa[0]
    for p in prompts:
        rows = _golden_last_rows(p.tokens)
        n = len(p.tokens)
        for i in csa:
            s = torch.from_numpy(rows[i])
            held = needle_entries(p.needle_tokens, n - 1, T.cfg.compress_ratios[i])
            want = entry_margin(s, held, k)["margin"]
            for arm in ("served", "planted"):
                r = mg[(mg.arm == arm) & (mg.prompt == p.id) & (mg.layer == i)].iloc[0]
                assert r.golden_margin == pytest.approx(want, abs=1e-12, nan_ok=True)
            assert mg[(mg.arm == "served") & (mg.prompt == p.id) & (mg.layer == i)].eps.iloc[0] == 0.0
        # the planted arm's first CSA layer sees golden's own scores (nothing changed
        # before it): its swap shows exactly half the gap between the k-th and (k+1)-th
        top = np.sort(rows[first][np.isfinite(rows[first])])[::-1]
        r = mg[(mg.arm == "planted") & (mg.prompt == p.id) & (mg.layer == first)].iloc[0]
        assert r.eps == pytest.approx((top[k - 1] - top[k]) / 2, abs=1e-12)
    planted = mg[mg.arm == "planted"]
    assert (planted.eps > 0).any()
    assert (mg[mg.arm == "served"].fragile.dropna() == False).all()     # noqa: E712 (ε = 0)
    s = summary.set_index(["arm", "layer"])
    assert (s.loc["served"].eps_max == 0).all() and s.loc[("planted", first)].eps_max > 0
    md = (rep / "summary.md").read_text()
    assert "Selection margins" in md and "lower bound" in md
