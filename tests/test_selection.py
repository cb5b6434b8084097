"""The indexer-picks judgement (fidelity.llamacpp.selection) on hand-built scores: a tie
reordered is never a finding, a worse entry picked instead is, by how much it gives up against
the scores' floor; an engine keeping fewer picks is named; the needle's entries are followed on
the last row with their margin to the boundary. Every expected number is worked by hand here."""
import numpy as np

from fidelity.llamacpp import selection as S

INF = np.inf


def _s(*rows):
    return np.array(rows, dtype=np.float64)


def test_a_tie_reordered_is_not_a_finding_but_a_worse_pick_is():
    s = _s([5, 4, 3, 3, 1])                           # entries 2 and 3 tie at the boundary
    twin = np.array([[0, 1, 2]])
    s64 = s + 1e-9                                    # the floor: 1e-9 (x2 slack)
    tie = S.compare(np.array([[0, 1, 3]]), twin, s, s64)
    assert (tie["differ"], tie["beyond"], tie["worst"]) == (1, 0, None)
    worse = S.compare(np.array([[0, 1, 4]]), twin, s, s64)      # gave up entry 2 (3) for entry 4 (1)
    assert (worse["differ"], worse["beyond"]) == (1, 1)
    assert worse["worst"]["loss"] == 2.0 and worse["worst"]["entry"] == 2
    assert np.isclose(worse["worst"]["x_floor"], 2.0 / 1e-9)
    same = S.compare(twin.copy(), twin, s, s64)
    assert (same["differ"], same["beyond"]) == (0, 0)


def test_a_loss_within_the_floor_is_a_tie_and_invisible_rows_are_not_judged():
    s = _s([5, 4, 3.0, 2.9999, 1], [5, 4, -INF, -INF, -INF])
    twin = np.array([[0, 1, 2], [0, 1, -1]])          # row 1 sees two entries: not judged
    s64 = s.copy()
    s64[0, 2] += 1e-3                                  # a floor of 1e-3 on row 0
    r = S.compare(np.array([[0, 1, 3], [1, 0, -1]]), twin, s, s64)
    assert r["rows"] == 1 and r["differ"] == 1 and r["beyond"] == 0   # 1e-4 given up < 2 x 1e-3


def test_fewer_picks_are_named_and_lose_what_they_drop():
    s = _s([5, 4, 3, 2, 1])
    r = S.compare(np.array([[0, 1]]), np.array([[0, 1, 2]]), s, s + 1e-9)
    assert (r["engine_k"], r["k"], r["beyond"]) == (2, 3, 1)
    assert r["worst"]["loss"] == 1.0                  # entry 2 (3) above the boundary (entry 3: 2)
    words = S.sentence([{"layer": 1, **r}])
    assert "keeps 2 picks per row where the twin keeps 3 (layer 1)" in words
    assert "1 of 1 rows at layer 1 lose an entry beyond the scores' floor" in words
    assert S.sentence([{"layer": 1, **S.compare(np.array([[0, 1, 2]]), np.array([[0, 1, 2]]), s, s)}]) is None


def test_the_needle_entry_on_the_last_row_with_its_margin():
    s = _s([5, 4, 3, 2, 1], [1, 2, 3.5, 4, 3])        # last row: top-3 = {3, 2, 4}; boundary entry 1 (2)
    twin = np.array([[0, 1, 2], [3, 2, 4]])
    kept = S.compare(np.array([[0, 1, 2], [3, 2, 4]]), twin, s, s, needle_entries=[2])
    assert kept["needle"] == {"entries": [2], "visible": True, "twin_kept": True, "engine_kept": True, "best": 2,
                              "margin": 1.5}        # 3.5 over the best entry not picked (2)
    lost = S.compare(np.array([[0, 1, 2], [3, 4, 1]]), twin, s, s, needle_entries=[2])
    assert lost["needle"]["twin_kept"] and not lost["needle"]["engine_kept"]
    words = S.sentence([{"layer": 3, **lost}])
    assert "The needle's entry is lost at layer 3." in words
    assert S.needle_entries([8, 9, 13], 4) == [2, 3]
    out = S.compare(np.array([[0, 1, 2], [3, 2, 4]]), twin, s, s, needle_entries=[0])
    assert out["needle"]["margin"] == -2.0 and not out["needle"]["twin_kept"]   # 1 below the kth (3)


def test_more_picks_than_top_k_lose_nothing_and_are_named():
    """An engine with index_topk raised keeps every entry the twin keeps and more: no row
    loses an entry, and the count itself is the finding."""
    s = _s([5, 4, 3, 2, 1])
    r = S.compare(np.array([[0, 1, 2, 3, 4]]), np.array([[0, 1, 2]]), s, s + 1e-9)
    assert (r["differ"], r["beyond"], r["engine_k"], r["k"]) == (1, 0, 5, 3)
    assert "it keeps 5 picks per row where the twin keeps 3 (layer 2)." in S.sentence([{"layer": 2, **r}])
