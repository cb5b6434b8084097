"""Outside oracle: transformers' own `DeepseekV4ForCausalLM` (v5, independent code) loaded
with the same random tiny weights must give the same fp32 logits as our golden forward
with simulated quantisation off (`Numerics("exact")`): relative L2 over all positions
(fp64 math) <= 1e-4 at 40, 130 and 300 tokens. At 300 tokens the CSA layers hold 75
compressed entries (> index_topk = 16, so the indexer really drops entries) and the HCA
layers 2. Measured: ~1e-6 at every length.

Where transformers deviates from DeepSeek's reference (docs/research/dsv4-architecture.md §4-§8), and how this test
bridges it. Our reference was NOT adapted to transformers; every bridge is on the
transformers side, inside tests/hf_oracle.py.

| # | Spot (research) | DeepSeek reference | transformers 5.24 | Bridge here |
|---|---|---|---|---|
| 1 | Indexer top-k ties (§8.11) | CUDA `torch.topk`, tie order unspecified; ours: lowest index first | CPU `Tensor.topk`, tie order unspecified | `lowest_index_topk_ties()`: monkeypatches `Tensor.topk` (only the indexer uses the method form; the router's `torch.topk` is untouched) to a stable descending sort during the oracle call. LOAD-BEARING: scores `sum_h w_h*relu(q_h.k)` are exactly 0 when all heads' dot products are negative (~1/16 of pairs with 4 heads), so ties at the k-th place happen; unpatched rel-L2 is 8e-3..6e-2 at 130/300 tokens (3 seeds) |
| 2 | YaRN amplitude (§4.6, §8.2) | none (cos/sin amplitude 1, scale head_dim^-0.5) | generic YaRN gives attention_factor 0.1 ln(factor)+1 = 1.277 unless set; `DeepseekV4Config` injects 1.0 for flat yarn params | pass `attention_factor=1.0` explicitly; `build_hf_model` asserts both RoPE tables have scaling 1.0; `test_rope_tables` checks inv_freq against §4.6 in fp64 |
| 3 | YaRN factor source | `rope_factor` | uses explicit `factor` (warns when max_position_embeddings/original disagrees; would derive it from that ratio if `factor` were absent) | pass `factor` explicitly |
| 4 | Indexer Hadamard + FP4 of q/k (§4.2, §4.4, §5.5) | rotate then FP4 round trip | neither | none needed in exact mode: the Hadamard is orthogonal, q.k is unchanged (fp32 rounding only); FP4 is off in `Numerics("exact")` |
| 5 | Indexer score precision (§5.5 step 4) | bf16 einsum/relu/mul/head-sum | fp32 | none needed (exact profile is fp32) |
| 6 | FP8 act-quant before FP8/FP4 GEMMs, FP8 KV sim (1x64), FP4 experts (§4.1-4.3, §5.3) | simulated | absent from the forward | compare against `Numerics("exact")` (all simulation off) |
| 7 | RMSNorm cast order (§4.5) | normalise fp32, times fp32 weight, one cast | same ("norm weights are kept in float32") | none (no deviation in this version) |
| 8 | Unweighted q rescale (§5.3.1) | bf16 tensor arithmetic | mean in fp32, rsqrt cast to x dtype, multiply | none needed in fp32 |
| 9 | mHC mixes (§5.2) | (X @ fn) * rsqrt(mean X^2) | (X * rsqrt) @ fn | reassociation only; none |
| 10 | hc_post (§5.2) | fp32 post/comb mixing, one cast | post/comb cast to stream dtype first | none needed in fp32 |
| 11 | Sinkhorn eps placement (§4.8) | softmax+eps, col-norm(+eps), iters-1 row/col pairs | identical | none |
| 12 | Shared-expert clamp (§1, §8.1, §8.16) | current rev: asymmetric clamp on shared and routed | same asymmetric clamp on both | none |
| 13 | Routing weight placement (§5.6.4) | scales h before w2 (inside w2's act-quant) | scales the expert OUTPUT after down_proj | linear, identical in exact math; none |
| 14 | Renormalisation (§5.6.3) | w / sum(w), only if score_func != softmax | always w / (sum(w) + 1e-20), ignores `norm_topk_prob` | tiny uses sqrtsoftplus (renormalised in both); 1e-20 is below fp32 resolution. A softmax-scored config would NOT be bridged |
| 15 | Router / hash routing precision (§5.6.1-2) | fp32 logits of bf16 x; hash picks `tid2eid[id]`, weights from unbiased scores | logits in model dtype; same hash/bias semantics | none needed in fp32 |
| 16 | MoE accumulation (§5.6.5-6) | routed + shared summed in fp32, one cast | routed cast to dtype, then + shared | none needed in fp32 |
| 17 | Compressor pooling (§5.4) | fp32 softmax per channel, fp32 pool, bf16 cast, norm, RoPE at j*r | fp32 softmax, weights cast to kv dtype, pool in kv dtype; same norm/RoPE/position | none needed in fp32 |
| 18 | Compressed / indexer visibility (§5.4.6, §5.5.5, §8.9) | entry j visible to t iff j < (t+1)//r; window t-W+1..t | same (block_bias, future_mask, `kv_idx > q_idx - W`) | none |
| 19 | Attention sink (§4.7) | exp(sink - M) in the denominator, M over selected rows; P rounded to bf16 | sink concatenated as an extra logit, max over all; fp32 P | identical in exact math; none |
| 20 | Head (§5.7, §8.21) | last position only | every position (`logits_to_keep=0`) | none: we compare every position; the head is per-token math (§6) |
| 21 | Per-layer compress ratios | any ratio per layer | one rate per layer type (4 for CSA, one HCA rate) | `hf_config` rejects configs with two HCA ratios |
| 22 | Decode path (§5.3.3-4) | ring buffer, per-step compressor | cache layers; a 1-token step gets no compressed mask (every emitted entry is complete) | not exercised: prefill only, `use_cache=False` |

No deviation of our model from the research spec was found: every layer's attention
output, FFN output and stream agree to ~1e-6 once (1) is bridged.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import build_hf_model, hf_logits  # noqa: E402

from reference_model.config import tiny  # noqa: E402
from reference_model.model import Model  # noqa: E402
from reference_model.numerics import Numerics  # noqa: E402
from reference_model.taps import Taps  # noqa: E402
from reference_model.weights import random_weights  # noqa: E402

LENGTHS = (40, 130, 300)
TOL = 1e-4
SEED = 0


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def oracle():
    import transformers.utils.logging as tlog
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # tiny GEMMs: extra threads only spin on a shared machine
    cfg = tiny()
    weights = random_weights(cfg, SEED)
    level = tlog.get_verbosity()
    tlog.set_verbosity_error()            # YaRN "implicit factor" notice: we pass factor explicitly
    try:
        hf = build_hf_model(cfg, weights)
    finally:
        tlog.set_verbosity(level)
    ours = Model(weights, Numerics("exact"))
    yield cfg, hf, ours
    torch.set_num_threads(threads)


def _run(cfg, hf, ours, S):
    """Both forwards on one prompt; also the indexer picks and raw HF indexer scores."""
    tokens = torch.randint(0, cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(100 + S))
    taps = Taps(["layers.*.attn.index.topk", "logits"])
    ours_logits = ours.prefill_logits(tokens, taps)
    picks, scores, handles = {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            handles.append(comp.indexer.register_forward_hook(
                lambda m, a, out, i=i: picks.__setitem__(i, out[0].detach())))
            handles.append(comp.indexer.scorer.register_forward_hook(
                lambda m, a, out, i=i: scores.__setitem__(i, out[0].detach())))
    try:
        hf_out = hf_logits(hf, tokens)
    finally:
        for h in handles:
            h.remove()
    return ours_logits, hf_out, taps, picks, scores


@pytest.fixture(scope="module")
def runs(oracle):
    cfg, hf, ours = oracle
    return {S: _run(cfg, hf, ours, S) for S in LENGTHS}


def test_lengths_exercise_sparse_selection():
    cfg = tiny()
    S = max(LENGTHS)
    assert S // 4 > cfg.index_topk, "longest length must give CSA more entries than index_topk"
    assert S // max(cfg.compress_ratios) >= 2, "longest length must give HCA several entries"
    assert min(LENGTHS) // 4 < cfg.index_topk, "shortest length: indexer keeps every visible entry"
    assert min(LENGTHS) < max(cfg.compress_ratios) < max(LENGTHS)


def test_rope_tables_match_spec(oracle):
    """transformers' inv_freq vs docs/research/dsv4-architecture.md §4.6 evaluated here in fp64; amplitude exactly 1."""
    cfg, hf, _ = oracle
    rot = hf.model.rotary_emb
    r = cfg.rope_head_dim
    i = torch.arange(0, r, 2, dtype=torch.float64)

    def spec(base, yarn):
        f = 1.0 / base ** (i / r)
        if not yarn:
            return f
        cd = lambda rot_: r * math.log(cfg.original_seq_len / (rot_ * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(cd(cfg.beta_fast)), 0), min(math.ceil(cd(cfg.beta_slow)), r - 1)
        ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        return f / cfg.rope_factor * ramp + f * (1 - ramp)

    assert torch.allclose(rot.main_inv_freq.double(), spec(cfg.rope_theta, False), rtol=1e-6, atol=0)
    assert torch.allclose(rot.compress_inv_freq.double(), spec(cfg.compress_rope_theta, True),
                          rtol=1e-6, atol=0)
    assert rot.main_attention_scaling == 1.0 and rot.compress_attention_scaling == 1.0


@pytest.mark.parametrize("S", LENGTHS)
def test_indexer_selects_same_entries(oracle, runs, S):
    """Diagnostic for the logits test: per CSA layer and query, the same set of
    compressed entries (order is irrelevant to attention)."""
    cfg, _, _ = oracle
    _, _, taps, picks, _ = runs[S]
    csa = [i for i in range(cfg.n_layers) if cfg.compress_ratios[i] == 4]
    assert sorted(picks) == csa
    for i in csa:
        ours = taps[f"layers.{i}.attn.index.topk"]
        theirs = picks[i]
        for t in range(S):
            a = set(ours[t].tolist()) - {-1}
            b = set(theirs[t].tolist()) - {-1}
            assert a == b, f"layer {i} query {t}: ours-only {sorted(a - b)}, hf-only {sorted(b - a)}"


def test_tie_bridge_is_load_bearing(oracle, runs):
    """Exact ties at the k-th indexer place do occur at these lengths, so the
    lowest-index tie rule (deviation 1) must be bridged for the comparison to mean anything."""
    cfg, _, _ = oracle
    S = max(LENGTHS)
    _, _, _, _, scores = runs[S]
    ties = 0
    for s in scores.values():                               # [S, n_entries], before masking
        for t in range(S):
            vis = s[t, : (t + 1) // 4]
            if vis.numel() > cfg.index_topk:
                v = vis.sort(descending=True).values
                ties += int(v[cfg.index_topk - 1] == v[cfg.index_topk])
    assert ties > 0


@pytest.mark.parametrize("S", LENGTHS)
def test_logits_match_transformers(runs, S):
    ours, theirs, _, _, _ = runs[S]
    assert ours.shape == theirs.shape
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    err = rel_l2(ours, theirs)
    print(f"S={S}: rel L2 = {err:.3e}")
    assert err <= TOL, f"S={S}: logits rel L2 {err:.3e} > {TOL:g}"
