"""The consistency verdict's words for a batch condition: replies that change only below the
greedy choice (a 1e-11 wobble, same tokens) read as numerics that move, not as a broken
answer; replies whose greedy tokens part read as differing."""
import pandas as pd

from fidelity.consistency.judge import verdict_lines


def _row(condition, flagged, diverged, kl, bitwise):
    return {"arm": "llama", "family": "batch", "condition": condition, "class": "concurrency",
            "shared": 8, "distinct": 1, "probes": 2, "bitwise": bitwise, "diverged": diverged,
            "first_step": 3 if diverged else None, "kl_max": kl, "kl_first_max": 0.0,
            "cached_median": None, "flagged": flagged, "why": ""}


def _lines(diverged):
    t = pd.DataFrame([_row("alone-again", False, 0, 0.0, 2), _row("batch@8", True, diverged, 1.1e-11, 0)])
    return verdict_lines(t)


def test_numerics_that_move_without_the_answer_are_said_so():
    (line,) = _lines(0)
    assert line.startswith("`llama` (batch) its numerics change (not its greedy answers) under 1 of 1")
    assert "same greedy tokens" in line and "alone vs alone: bit-identical" in line


def test_answers_that_part_are_a_difference():
    (line,) = _lines(1)
    assert line.startswith("`llama` (batch) differs from its alone replies under 1 of 1")
    assert "greedy tokens part from step 3 in 1/2" in line
