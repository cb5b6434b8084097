"""index_topk_override (kernel_toggles/index_topk.py): an engine keeping more or fewer entries
per row than the checkpoint's index_topk. Against hand-derived picks: a longer top-k holds the
reference's picks and the next best, a shorter one the best few, the same k is the reference
bit for bit, and rows that see fewer entries pad with -1 as the reference does."""
import torch

from kernel_toggles import ToggleSet
from reference_model.numerics import Numerics


def _picks(nx, k, visible=(5,)) -> list[list[int]]:
    """Each row's picks as a sorted list (-1 padding first): the order within a row is not
    what attention reads."""
    return [sorted(r) for r in _select(nx, k, visible)[1].tolist()]


def _select(nx, k, visible=(5,)):
    keys = torch.tensor([[1.0, 0], [5.0, 0], [3.0, 0], [4.0, 0], [2.0, 0]])     # relu(q . key): 1 5 3 4 2
    q = torch.tensor([[[1.0, 0.0]]] * len(visible))
    return nx.index_select(q, keys, torch.ones(len(visible), 1), torch.tensor(list(visible)), k)


def test_the_engine_keeps_its_own_number_of_entries():
    exact = Numerics("exact")
    longer = ToggleSet.parse("index_topk_override(topk=4)").numerics("exact")
    shorter = ToggleSet.parse("index_topk_override(topk=1)").numerics("exact")
    same = ToggleSet.parse("index_topk_override(topk=2)").numerics("exact")
    assert _picks(exact, 2) == [[1, 3]]                                 # scores 5, 4
    assert _picks(longer, 2) == [[1, 2, 3, 4]]                          # and 3, 2 after them
    assert _picks(shorter, 2) == [[1]]
    assert torch.equal(_select(same, 2)[1], _select(exact, 2)[1])
    assert torch.equal(_select(longer, 2)[0], _select(exact, 2)[0])     # the exact scores kept


def test_rows_that_see_fewer_entries_pad_as_the_reference_does():
    longer = ToggleSet.parse("index_topk_override(topk=4)").numerics("exact")
    assert _picks(longer, 2, visible=(2, 5)) == [[-1, -1, 0, 1], [1, 2, 3, 4]]


def test_an_engine_launch_carries_the_arms_own_topk():
    """The launcher's settings for the arm put its topk in the engines' config overrides
    (engine_profiles.json placeholders), not the checkpoint's: no "behaves as" refusal."""
    from kernel_toggles.profiles import launch_settings
    arm = ToggleSet.parse("index_topk_override(topk=2048)")
    vllm, sglang = launch_settings(arm, "vllm"), launch_settings(arm, "sglang")
    assert vllm.flags[vllm.flags.index("--hf-overrides") + 1] == '{"index_topk": 2048}'
    assert sglang.flags[sglang.flags.index("--json-model-override-args") + 1] == '{"index_topk": 2048}'
    for s in (vllm, sglang):
        assert "index_topk_override" in s.applied and "index_topk_override" in s.unconfirmed
        assert not [t for t, _ in s.unrealisable if t == "index_topk_override"]


def test_a_tie_at_the_boundary_is_kept_from_the_larger_index_under_tie_break_large():
    """Scores 5, 3, 3, 3, 1 with k = 2: 5 is kept by both; of the three tied 3s the reference
    keeps entry 1 (smaller index), FlashInfer's LARGE keeps entry 3; small is the reference."""
    s = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    ref = Numerics("exact")
    large = ToggleSet.parse("index_topk_tie_break").numerics("exact")
    small = ToggleSet.parse("index_topk_tie_break(mode=small)").numerics("exact")
    assert sorted(ref.index_topk(s, 2)[0].tolist()) == [0, 1]
    assert sorted(large.index_topk(s, 2)[0].tolist()) == [0, 3]
    assert torch.equal(small.index_topk(s, 2), ref.index_topk(s, 2))
    untied = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])              # no tie: the same set
    assert sorted(large.index_topk(untied, 2)[0].tolist()) == [0, 1]
