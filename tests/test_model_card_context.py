"""The model card's recall-vs-context tables (training.model_card --context): recall per arm
and length against golden with exact McNemar, and the mechanism per CSA layer, on rows
whose answers are worked out by hand."""
from __future__ import annotations

import json

from training.model_card import context_mechanism_md, context_recall_md


def _row(arm, tid, length, correct, picks, margin, in_topk=True):
    return {"type": "trial", "arm": arm, "trial_id": tid, "length": length, "depth": 50.0, "rep": tid,
            "outcome": "correct" if correct else "wrong", "recall": 1.0 if correct else 0.0,
            "mechanism": [{"layer": 1, "in_topk": in_topk, "in_window": False, "picks": picks,
                           "margin": margin, "best_rank": 1, "topk": 4}]}


def _rows():
    """golden: 4 trials, 3 right; `x`: loses trial 0 (golden right) and wins trial 3, and on
    trial 1 drops the needle's entry (pick 9 -> 7), so one of four picks differs."""
    g = [_row("golden", 0, 1024, True, [1, 2, 3, 9], 2.0),
         _row("golden", 1, 1024, True, [1, 2, 3, 9], 0.5),
         _row("golden", 2, 4096, True, [1, 2, 3, 9], 4.0),
         _row("golden", 3, 4096, False, [1, 2, 3, 9], 1.0)]
    x = [_row("x", 0, 1024, False, [1, 2, 3, 9], 1.8),
         _row("x", 1, 1024, True, [1, 2, 3, 7], -0.1, in_topk=False),
         _row("x", 2, 4096, True, [1, 2, 3, 9], 3.8),
         _row("x", 3, 4096, True, [1, 2, 3, 9], 1.4)]
    return g + x


def test_context_recall_table():
    md = context_recall_md(_rows())
    assert md[0].startswith("| arm | 1024 | 4096 | all [95% Wilson] | vs golden")
    golden, x = md[2], md[3]
    assert golden.startswith("| golden | 1.00 | 0.50 | 0.750 [") and golden.endswith("n=4 |  |")
    # one discordant pair each way: exact two-sided binomial p = 1
    assert x.startswith("| x | 0.50 | 1.00 | 0.750 [") and x.endswith("n=4 | 1 / 1, p = 1 |")


def test_context_mechanism_table():
    md = context_mechanism_md(_rows())
    assert len(md) == 3                          # one arm, one CSA layer
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    # Jaccard: trial 1 shares 3 of 5 picks, the others all 4: (3 * 1 + 0.6) / 4 = 0.9
    assert cells[:4] == ["x", "1", "0.900", "3/4"]
    assert cells[4] == "1 / 0, p = 1"           # golden kept the needle's entry, x lost it once
    # golden's margins 2, 0.5, 4, 1 -> median 1.5; |shifts| 0.2, 0.6, 0.2, 0.4 -> median 0.3;
    # fragile: margins below 0.6 -> 0.5 only, 1 of 4
    assert cells[5:] == ["1.50", "0.300", "0.250"]


def test_context_tables_from_a_results_file(tmp_path):
    """The tables read a sweep's results file as committed (header line, then rows), with
    the arms in the header's order even when the other arm's trials finished first."""
    from training.model_card import _fill_context
    p = tmp_path / "ctx.jsonl"
    header = {"type": "header", "schema_version": 1, "arms": [{"name": "golden"}, {"name": "x"}]}
    rows = _rows()
    p.write_text("\n".join(json.dumps(r) for r in [header] + rows[4:] + rows[:4]) + "\n")
    md, summary = _fill_context("A\n{{CONTEXT_RECALL:near}}\nB\n{{CONTEXT_MECHANISM:near}}\n", {"near": [p]})
    assert "{{" not in md and "| x | 0.50 | 1.00 |" in md and "| x | 1 | 0.900 |" in md
    assert summary["near"]["mechanism_pairs"][0]["a_only"] == 1


def test_paired_table_counts_shared_trials_only():
    """Two checkpoints' sweeps: trials only one gets right, both right, exact p; a trial
    only one sweep ran is not a pair."""
    from training.model_card import paired_md
    g = [r for r in _rows() if r["arm"] == "golden"]
    x = [dict(r, arm="golden") for r in _rows() if r["arm"] == "x"][:3]     # trial 3 not run
    md = paired_md({"new": g, "old": x}, [("new", "old")])
    # shared trials 0-2: new right on all three, old wrong on 0 -> 1 / 0, both 2, p = 1
    assert md[2] == "| new vs old | 3 | 1 | 0 | 2 | 1 |"


def test_context_trend_table():
    from training.model_card import context_trend_md
    md = context_trend_md(_rows())
    # 1024: golden margins 2.0, 0.5 -> median 1.25, smallest 0.5; x's shifts 0.2, 0.6 ->
    # median 0.4, largest 0.6; trial 1 is fragile (0.6 > 0.5 / 2), trial 0 not (0.2 < 1.0)
    assert md[2] == "| 1 | 1024 | 2 | 1.25 (0.50) | 0.400 (x) | 0.600 (x) | 1 |"
    # 4096: margins 4.0, 1.0; shifts 0.2, 0.4 -> none over half its margin
    assert md[3] == "| 1 | 4096 | 2 | 2.50 (1.00) | 0.300 (x) | 0.400 (x) | 0 |"
