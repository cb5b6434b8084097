"""HISA (kernel_toggles/hisa.py), mlx-vlm's approximate indexer selection, against hand-derived
cases and an fp64 transcription of its two stages; mlx-vlm's own hisa_select is the outside
oracle in test_mlxvlm_engine.py (marked `mlx`)."""
import numpy as np
import torch

from kernel_toggles import ToggleSet
from reference_model.numerics import Numerics

INF = float("inf")


def _select(nx, keys, q, visible, k, w=None):
    q = torch.tensor(q, dtype=torch.float32).reshape(len(q), 1, -1)
    keys = torch.tensor(keys, dtype=torch.float32)
    w = torch.ones(q.shape[0], 1) if w is None else torch.tensor(w, dtype=torch.float32)
    return nx.index_select(q, keys, w, torch.tensor(visible), k)


def _arm(spec):
    return ToggleSet.parse(spec).numerics("exact")


def test_a_block_whose_mean_scores_low_loses_its_best_entry():
    # block 0: (4,0) and (-4,0), mean (0,0): coarse 0; block 1: two (1,0), mean (1,0): coarse 1
    keys = [[4, 0], [-4, 0], [1, 0], [1, 0]]
    exact = _select(Numerics("exact"), keys, [[1, 0]], [4], 1)[1]
    hisa = _select(_arm("hisa(block=2,keep=1)"), keys, [[1, 0]], [4], 1)[1]
    assert exact.tolist() == [[0]]                       # relu(q.k) = 4 is the best
    assert hisa.tolist() in ([[2]], [[3]])               # only block 1 was kept
    scores = _select(_arm("hisa(block=2,keep=1)"), keys, [[1, 0]], [4], 1)[0]
    assert scores.tolist() == [[4, 0, 1, 1]]             # the exact scores are kept for margins


def test_entries_after_the_last_full_block_are_never_candidates():
    keys = [[1, 0], [1, 0], [1, 0], [1, 0], [9, 0]]      # entry 4: the best, in no full block
    assert _select(Numerics("exact"), keys, [[1, 0]], [5], 1)[1].tolist() == [[4]]
    assert _select(_arm("hisa(block=2,keep=2)"), keys, [[1, 0]], [5], 1)[1].tolist() != [[4]]


def test_blocks_a_row_cannot_see_are_out_and_short_rows_pad_with_minus_one():
    keys = [[1, 0], [0, 0], [9, 0], [9, 0]]
    # the row sees 2 entries: block 1 (starting at 2) is out, block 0 kept, its entry 0 picked
    got = _select(_arm("hisa(block=2,keep=1)"), keys, [[1, 0]], [2], 2)[1]
    assert sorted(got.tolist()[0]) == [0, 1]
    got = _select(_arm("hisa(block=2,keep=1)"), keys, [[1, 0]], [1], 2)[1]
    assert sorted(got.tolist()[0]) == [-1, 0]            # one visible candidate: the rest -1


def test_off_below_keep_times_block_entries_or_when_top_k_exceeds_it():
    rng = np.random.default_rng(0)
    keys, q = rng.normal(size=(7, 4)), rng.normal(size=(3, 4))
    base = _select(Numerics("exact"), keys, q, [7, 7, 7], 2)[1]
    assert torch.equal(_select(_arm("hisa(block=4,keep=2)"), keys, q, [7, 7, 7], 2)[1], base)   # 7 < 8 entries
    keys = rng.normal(size=(12, 4))
    base = _select(Numerics("exact"), keys, q, [12, 12, 12], 5)[1]
    assert torch.equal(_select(_arm("hisa(block=2,keep=2)"), keys, q, [12, 12, 12], 5)[1], base)  # k 5 > 4


def _oracle(keys, q, w, visible, k, block, keep):
    """HISA in fp64 numpy, from the paper's two stages and mlx-vlm's causal rules."""
    nb = len(keys) // block
    out = []
    for qi, wi, v in zip(q, w, visible):
        score = lambda kk: (np.maximum(qi @ kk.T, 0) * wi[:, None]).sum(0)  # noqa: E731
        reps = keys[: nb * block].reshape(nb, block, -1).mean(1)
        cs = np.where(np.arange(nb) * block < v, score(reps), -np.inf)
        blocks = [b for b in np.argsort(-cs, kind="stable")[:keep] if np.isfinite(cs[b])]
        cand = [b * block + j for b in blocks for j in range(block) if b * block + j < v]
        fs = score(keys[cand]) if cand else np.zeros(0)
        out.append(sorted(cand[i] for i in np.argsort(-fs, kind="stable")[:k]))
    return out


def test_matches_an_fp64_transcription_on_random_rows():
    rng = np.random.default_rng(1)
    n, h, d = 40, 3, 8
    keys, q, w = rng.normal(size=(n, d)), rng.normal(size=(12, h, d)), rng.uniform(0.1, 1, size=(12, h))
    visible = rng.integers(1, n + 1, size=12)
    got = ToggleSet.parse("hisa(block=4,keep=3)").numerics("exact", compute_dtype=torch.float64).index_select(
        torch.tensor(q), torch.tensor(keys), torch.tensor(w), torch.tensor(visible), 5)[1]
    want = _oracle(keys, q, w, visible, 5, 4, 3)
    assert [sorted(x for x in row if x >= 0) for row in got.tolist()] == want


def test_a_recording_copy_records_the_exact_scores_while_hisa_picks():
    """needle's mechanism ranks the needle's entries on the recorded scores: they must be the
    exact ones, also on an arm whose picks come from HISA (its copy records every call)."""
    got = []
    keys = [[4, 0], [-4, 0], [1, 0], [1, 0]]
    scores, picks = _select(_arm("hisa(block=2,keep=1)").recording_index_scores(got.append), keys, [[1, 0]], [3], 1)
    assert len(got) == 1 and got[0].tolist() == [[4, 0, 1, -INF]]          # entry 3 not visible
    assert picks.tolist() == [[2]]                                         # HISA's pick, not entry 0
