"""The seam's newer kernels (RoPE application, positions, visibility, MoE selection, SwiGLU)
against hand-derived values and fp64 math, and the composition rule for toggles that
replace the same kernel."""
import math

import pytest
import torch

import kernel_toggles as K
from kernel_toggles.registry import ToggleError
from reference_model import Numerics

F64 = torch.float64
GOLD = Numerics("reference")
EXACT = Numerics("exact", F64)


@pytest.mark.parametrize("nm", [GOLD, EXACT])
def test_rope_apply_interleaved_pairs_by_hand(nm):
    """Pair (2i, 2i+1) of the last 2·len(f) dims rotates by t·f_i; the head dims before are
    untouched; inverse undoes it. Values are bf16-exact so the reference's bf16 store of
    the result is the only rounding."""
    inv = torch.tensor([1.0, 0.25], dtype=F64)
    x = torch.tensor([[3.0, 1.0, 0.0, 1.0, 0.0],
                      [3.0, 1.0, 0.0, 1.0, 0.0]], dtype=F64)      # 1 free dim + 2 pairs
    pos = torch.tensor([0, 2])
    y = nm.rope_apply(x, inv, pos, "q").double()
    assert y[0].tolist() == [3.0, 1.0, 0.0, 1.0, 0.0]                # position 0: identity
    want = [3.0, math.cos(2.0), math.sin(2.0), math.cos(0.5), math.sin(0.5)]
    tol = 0 if nm is EXACT else 2 ** -8
    for g, w in zip(y[1].tolist(), want):
        assert g == pytest.approx(w, abs=tol * abs(w) + 1e-15)
    back = nm.rope_apply(nm.rope_apply(x, inv, pos, "kv"), inv, pos, "output", inverse=True).double()
    assert torch.allclose(back, x, atol=0.02 if nm is GOLD else 1e-14)


def test_positions_visibility_and_window_by_hand():
    pos = torch.tensor([0, 3, 4, 7, 127, 128])
    assert GOLD.compressed_visible(pos, 4).tolist() == [0, 1, 1, 2, 32, 32]
    assert GOLD.compressed_visible(pos, 128).tolist() == [0, 0, 0, 0, 1, 1]
    assert GOLD.compressed_positions(torch.tensor([0, 1, 5]), 4).tolist() == [0, 4, 20]
    assert GOLD.window_first(torch.tensor([0, 31, 100]), 32).tolist() == [-31, 0, 69]
    ape = torch.tensor([[10.0], [20.0], [30.0], [40.0]], dtype=F64)
    s = torch.zeros(3, 1, dtype=F64)
    assert GOLD.compress_score_bias(s, ape, torch.tensor([5, 6, 8]), 4).flatten().tolist() == [20.0, 30.0, 10.0]


def test_moe_select_hash_and_biased_topk():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.4]], dtype=F64)
    bias = torch.tensor([0.0, 1.0, 0.0, 0.0])
    tid2eid = torch.tensor([[3, 2], [0, 1]])
    # scored layer: top-2 of score + bias = [0.9, 1.1, 0.5, 0.4] -> experts 1 and 0
    assert sorted(GOLD.moe_select(scores, bias, torch.tensor([1]), None, 2, 5, False)[0].tolist()) == [0, 1]
    # hash layer: the token's row of tid2eid, scores and bias ignored
    assert GOLD.moe_select(scores, None, torch.tensor([0]), tid2eid, 2, 0, True).tolist() == [[3, 2]]
    # weights come from the UNBIASED scores of the picks: 0.9/(0.9+0.1)·1.5, 0.1/1.0·1.5
    w = GOLD.route_weights(scores, torch.tensor([[0, 1]]), bias, 1.5).double()
    assert torch.allclose(w, torch.tensor([[1.35, 0.15]], dtype=F64), atol=1e-7)


def test_swiglu_asymmetric_clamp_by_hand():
    g = torch.tensor([-12.0, 15.0, 2.0], dtype=F64)
    u = torch.tensor([3.0, 20.0, -11.0], dtype=F64)
    got = EXACT.swiglu(g, u, 10.0).tolist()

    def silu(v):
        return v / (1 + math.exp(-v))
    want = [silu(-12.0) * 3.0, silu(10.0) * 10.0, silu(2.0) * -10.0]
    assert got == pytest.approx(want, rel=1e-14)
    assert EXACT.swiglu(g, u, 0.0).tolist() == pytest.approx([silu(-12.0) * 3, silu(15.0) * 20, silu(2.0) * -11],
                                                              rel=1e-14)


# ---- composition ------------------------------------------------------------------------
@pytest.fixture
def two_on_one_kernel():
    names = []

    def reg(name, wraps=()):
        names.append(name)

        @K.toggle(name, kernel="wo_a", category="known-bug", wraps=wraps,
                  description=f"test toggle {name}: scales wo_a by 2")
        def _f(golden, o, w):
            return golden.wo_a(o, w) * 2
    yield reg
    for n in names:
        K.registry.unregister(n)


def test_same_kernel_twice_is_refused_naming_both(two_on_one_kernel):
    two_on_one_kernel("test_first_wo_a")
    two_on_one_kernel("test_second_wo_a")
    with pytest.raises(ToggleError, match="test_first_wo_a and test_second_wo_a both replace kernel wo_a"):
        K.ToggleSet.parse("test_second_wo_a,test_first_wo_a")


def test_wrapping_toggles_compose(two_on_one_kernel):
    two_on_one_kernel("test_first_wo_a")
    two_on_one_kernel("test_wrapping_wo_a", wraps=True)
    nx = K.ToggleSet.parse("test_first_wo_a,test_wrapping_wo_a").numerics()
    o, w = torch.ones(1, 1, 2, dtype=F64), torch.ones(1, 1, 2, dtype=F64)
    assert nx.wo_a(o, w).item() == 8.0                      # 2 · 2 · golden (2)


def test_subsumed_toggle_is_refused_and_left_out_of_engine():
    with pytest.raises(ToggleError, match="index_keys_fp8 already includes index_scores_fp32"):
        K.ToggleSet.parse("index_scores_fp32,index_keys_fp8")
    assert "index_scores_fp32" not in K.engine() and "index_keys_fp8" in K.engine()
    assert "index_scores_fp32" not in K.engine("sglang")


def test_ascii_engine_minus_syntax():
    e = K.engine()
    arm = K.ToggleSet.parse("engine-wo_a_fp8-mhc_tf32")
    assert arm == e.without("wo_a_fp8", "mhc_tf32")
    assert K.ToggleSet.parse("engine-wo_a_fp8,routed_scaling_double") == e.without("wo_a_fp8").with_("routed_scaling_double")
    with pytest.raises(ToggleError, match="not in arm"):
        K.ToggleSet.parse("engine-routed_scaling_double")


def test_toggle_on_inner_kernel_acts_inside_another_toggles_kernel(two_on_one_kernel):
    """moe_weight_after_w2 replaces expert_ffn and calls golden.swiglu: a later toggle on
    swiglu must act there too (no silent shadowing across kernels)."""
    @K.toggle("test_swiglu_zero", kernel="swiglu", category="known-bug", description="test: zero")
    def _z(golden, g, u, limit):
        return g * 0
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 128, generator=g, dtype=F64)
        w1, w3 = torch.randn(128, 128, generator=g, dtype=F64), torch.randn(128, 128, generator=g, dtype=F64)
        w2 = torch.randn(128, 128, generator=g, dtype=F64)
        wt = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
        nx = K.ToggleSet.parse("moe_weight_after_w2,test_swiglu_zero").numerics()
        assert nx.expert_ffn(x, w1, w3, w2, wt, 10.0).abs().max().item() == 0
        assert nx.expert_ffn(x, w1, w3, w2, None, 10.0).abs().max().item() == 0
        alone = K.ToggleSet.parse("moe_weight_after_w2").numerics()
        assert alone.expert_ffn(x, w1, w3, w2, wt, 10.0).abs().max().item() > 0
    finally:
        K.registry.unregister("test_swiglu_zero")
