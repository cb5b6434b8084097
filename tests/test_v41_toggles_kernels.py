"""The engines' readings of docs/v41-architecture.md §9 as kernels, checked by hand on
values small enough to follow; D9 (candidate_underfill_keep) on a config whose candidate
pool is smaller than index_topk; the `engine` arm per model version."""
import dataclasses

import pytest
import torch

import kernel_toggles as K
from reference_model import Numerics, Taps, tiny
from reference_model.v41.config import tiny_v41, validate
from reference_model.v41.model import ModelV41
from reference_model.v41.weights import random_weights

NX = Numerics("reference")


def _nx(arm: str):
    return K.ToggleSet.parse(arm, model="v41").numerics()


def test_rmsnorm_cast_first_rounds_the_normalised_input_first():
    """x = (3, 4): x̂ = (0.84853, 1.13137); w = (1.5, 3). Cast first: bf16(x̂) = (0.84765625,
    1.1328125), times w = (1.271484375, 3.3984375) -> bf16 (1.2734375, 3.40625: a tie, to
    even). Reference: bf16(1.27279, 3.39411) = (1.2734375, 3.390625)."""
    x, w = torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.tensor([1.5, 3.0])
    assert NX.rms_norm(x, w, 1e-20).tolist() == [[1.2734375, 3.390625]]
    assert _nx("rmsnorm_cast_first").rms_norm(x, w, 1e-20).tolist() == [[1.2734375, 3.40625]]


def test_compressed_kv_mxfp8_is_e4m3_with_a_power_of_two_scale_per_32():
    """amax 3: scale 2^ceil(log2(3/448)) = 2^-7; 3/2^-7 = 384 (an e4m3 value);
    bf16(0.1)/2^-7 = 12.81 -> 13 -> 0.1015625. The second block (all 0.5) is exact."""
    x = torch.zeros(1, 64, dtype=torch.float64)
    x[0, 0], x[0, 1], x[0, 32:] = 3.0, 0.1, 0.5
    y = _nx("compressed_kv_mxfp8").compressed_kv_store(x)
    assert y[0, :3].tolist() == [3.0, 0.1015625, 0.0] and (y[0, 32:] == 0.5).all()
    assert _nx("compressed_kv_bf16").compressed_kv_store(x)[0, 1].item() == 0.10009765625


def test_attn_logits_bf16_by_hand():
    """q = (1, 1), rows k1 = (1, 2^-9), k2 = 0, sink 0, scale 1. q·k1 = 1.001953125 is 1.0
    in bf16, so the softmax over (1, 0, sink 0) gives e/(e+2) = 0.576117 -> bf16 147/256;
    out = 147/256 · k1 = (147/256, 147/131072), both exact in bf16."""
    q = torch.ones(1, 1, 2, dtype=torch.float64)
    kv = torch.tensor([[1.0, 2.0 ** -9], [0.0, 0.0]], dtype=torch.float64)
    args = (q, kv, torch.zeros(1), torch.tensor([[0, 1]]), 1.0)
    out = _nx("attn_logits_bf16").sparse_attention(*args)
    assert out.flatten().tolist() == [147 / 256, 147 / 131072]
    assert not torch.equal(NX.sparse_attention(*args), out)


def test_candidate_underfill_keep_by_hand():
    """Scores (5, 1, 4, 2, 3, 0), candidates {2}, top-3: golden keeps only 2; REF's reading
    adds visible positions outside the candidates (lowest first: 0, 1); with 1 visible
    entry only position 0. A pool of 3 >= top-3: both readings agree."""
    s = torch.tensor([[5.0, 1, 4, 2, 3, 0]])
    one = torch.tensor([[False, False, True, False, False, False]])
    keep = _nx("candidate_underfill_keep")
    assert NX.candidate_topk(s, one, torch.tensor([5]), 3).tolist() == [[-1, -1, 2]]
    assert keep.candidate_topk(s, one, torch.tensor([5]), 3).tolist() == [[0, 1, 2]]
    assert sorted(keep.candidate_topk(s, one, torch.tensor([1]), 3)[0].tolist()) == [-1, 0, 2]
    three = torch.tensor([[True, True, True, False, False, False]])
    assert keep.candidate_topk(s, three, torch.tensor([5]), 3).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("blocks", [4, 1])
def test_candidate_underfill_keep_acts_only_where_the_pool_is_below_topk(blocks):
    """Tiny config (4 blocks x 4 = 16 candidate positions >= index_topk 8): identical to
    golden. One block (4 positions < 8): logits move from the first position whose visible
    entries outnumber its pool (t = 4, five entries, the newest block holding one)."""
    cfg = validate(dataclasses.replace(tiny_v41(), candidate_topk_blocks=blocks))
    w = random_weights(cfg, 0)
    toks = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    g = ModelV41(w, NX).prefill_logits(toks)
    a = ModelV41(w, _nx("candidate_underfill_keep")).prefill_logits(toks)
    moved = ((a - g).abs().amax(-1) > 0).nonzero().flatten().tolist()
    assert moved == ([] if blocks == 4 else list(range(4, 20)))


def test_engine_arm_follows_the_model_version():
    v4, v41 = K.engine(), K.engine(model="v41")
    assert v41.names == ("index_keys_fp8", "splitk_decode", "wo_a_fp8", "routed_scaling_output_bf16",
                         "lm_head_bf16", "rmsnorm_cast_first", "compressor_norm_fp32",
                         "compressed_kv_mxfp8")
    assert not {"kv_fp8_from_fp32", "compress_state_bf16", "mhc_tf32", "moe_weight_after_w2"} & set(v41.names)
    assert not {"rmsnorm_cast_first", "compressor_norm_fp32", "compressed_kv_mxfp8"} & set(v4.names)
    assert K.ToggleSet.parse("engine-lm_head_bf16", model="v41") == v41.without("lm_head_bf16")
    assert K.ToggleSet.parse("engine") == v4
    from kernel_toggles.arms import version_of
    assert (version_of(tiny()), version_of(tiny_v41())) == ("v4", "v41")
    with pytest.raises(K.ToggleError, match="unknown model version"):
        K.engine(model="v5")


@pytest.mark.parametrize("scale, codes, s", [("fp32", [448, 224, -112, 0], 2 / 448),
                                             ("pow2", [256, 128, -64, 0], 2.0 ** -7)])
def test_index_keys_fp8_on_v41_index_keys_by_hand(scale, codes, s):
    """D8: a V4.1 index key (2, 1, -0.5, 0) as one FP8 row: scale amax/448 = 2/448 (SGLang)
    or its power of two above, 2^-7 (vLLM); codes x/s are e4m3 values; packed [codes | s].
    The query is quantised per (token, head) the same way."""
    nx = _nx(f"index_keys_fp8(scale={scale})")
    k = torch.tensor([[2.0, 1.0, -0.5, 0.0]], dtype=torch.float64)
    packed = nx.index_fp4(k, "k")
    assert packed[0, :4].tolist() == codes and packed[0, 4].item() == pytest.approx(s, rel=1e-7)
    q = torch.stack([k, 2 * k], 1)                                   # [1 token, 2 heads, 4]
    assert nx.index_fp4(q, "q")[0, :, :4].tolist() == [codes, codes]


@pytest.mark.parametrize("n", [12, 16])
def test_engram_dead_window_acts_only_while_the_context_is_below_the_window(n):
    """Tiny window 16: a 12-token prompt hashes every token DEAD (all-pad n-grams: one id
    per column for every position) and sees no compressed entry (index top-k all -1);
    a 16-token prompt is golden's bit for bit."""
    w = random_weights(tiny_v41(), 0)
    toks = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(3))
    runs = []
    for nx in (NX, _nx("engram_dead_window(window=16)")):
        taps = Taps("*")
        runs.append((ModelV41(w, nx).extend(toks, None, "all", taps)[0], taps))
    (g, _), (a, taps) = runs
    if n == 16:
        assert torch.equal(a, g)
        return
    ids = taps["layers.1.engram.ids"]
    assert not torch.equal(a, g) and (ids == ids[0]).all()
    assert (taps["layers.2.attn.index.topk"] == -1).all() and (taps["layers.8.attn.index.topk"] == -1).all()
