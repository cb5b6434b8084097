"""Built-in DeepSeek-V4.1 toggles: the readings of docs/v41-architecture.md §9 that are not
the reference's, and V4 behaviours a V4.1 port carried over, each with the PR or issue it
comes from. They replace V4.1 kernels (reference_model/v41/numerics.py), so on a V4 model
they never act; existing V4 toggles on kernels both versions share (index_scores_fp32 is
§9 D2, lm_head_bf16 D6, splitk_decode, wo_a_fp8, ...) act on V4.1 too.

Registered after builtin.py's, in forward order. Every toggle here is documented for V4.1
only (`versions`), so V4's `engine` arm is unchanged; the optimizations among them join
V4.1's (kernel_toggles.arms.engine(model='v41'))."""
from __future__ import annotations

import torch

from reference_model import quant as Q
from reference_model.primitives import topk_lowest_index_ties
from reference_model.v41.kernels import DEAD

from . import emulate as E
from .registry import Param, Provenance, toggle

_B = dict(_builtin=True, category="known-bug")
_OPT = dict(_builtin=True, category="optimization", versions=("v41",))


@toggle("engram_history_microbatch", kernel="engram_hash", **_B,
        provenance=Provenance(("vllm",), ("deepseek_v41 before the fix",),
                              ("vLLM PR #56440", "vLLM issue #56224"),
                              "our reading: the history is lost at every forward call"),
        description="Engram n-gram history lost at a batch boundary: each call hashes its "
                    "tokens as if they started the sequence (positions counted from the "
                    "call's first token, earlier tokens unseen), so the first positions of "
                    "every decode step and prefill chunk hash pad-blocked n-grams. vLLM #56440 "
                    "(issue #56224) fixed it: 'Reconstruct the history immediately before the "
                    "microbatch's first actual token, preserve absolute positions'. A one-shot "
                    "prefill is unaffected; decode steps are.")
def _engram_history_microbatch(golden, hist, positions, layout, pad_c):
    p0 = int(positions[0])
    return golden.engram_hash(hist[p0:], positions - p0, layout, pad_c)


@toggle("engram_dead_window", kernels=("engram_hash", "compressed_visible"), wraps=True,
        versions=("v41",), **_B,
        params=(Param("window", int, 128, "the sliding window (128 in V4.1-Flash, 16 in the "
                      "tiny config)", min=1),),
        provenance=Provenance(("transformers",), ('cache_implementation="static"',),
                              ("transformers PR #48721 (self-review)",),
                              "our reading: the context is the tokens seen so far (prompt, "
                              "then each decode step); past the window it is the golden"),
        description="A padded static-cache mask whose liveness diagonal is mis-located: while "
                    "the context is shorter than the sliding window, every token is hashed "
                    "DEAD for Engram (all n-grams pad-blocked) and no compressed entry is "
                    "visible, as if no group had been emitted. transformers PR #48721's "
                    "self-review: 'every `cache_implementation=\"static\"` run whose context "
                    "stays under 128 tokens'. Set window to the model's sliding window.")
def _engram_dead_window(window):
    def engram_hash(golden, hist, positions, layout, pad_c):
        if hist.shape[0] < window:
            hist = torch.full_like(hist, DEAD)
        return golden.engram_hash(hist, positions, layout, pad_c)

    def compressed_visible(golden, positions, ratio):
        visible = golden.compressed_visible(positions, ratio)
        return visible * 0 if int(positions.max()) + 1 < window else visible

    return {"engram_hash": engram_hash, "compressed_visible": compressed_visible}


@toggle("v41_v4_hc_order", kernel="hc_pre_lagged", **_B,
        provenance=Provenance(("ik_llama.cpp",), ("a port keeping V4's mHC order",),
                              ("ik_llama.cpp PR #2455",),
                              "no bug report found; #2455 names the lag among V4.1's changes"),
        description="mHC in V4's order: each site collapses its input streams with its own "
                    "pre-mix instead of the previous site's (V4.1 lags the pre-mix by one "
                    "site: the attention uses the last block's FFN pre-mix, the FFN the "
                    "attention's, the head the last FFN's). ik_llama.cpp PR #2455 lists the "
                    "lag as one of the four differences a V4 port must change.")
def _v4_hc_order(golden, H, pre_prev, pre_own):
    return golden.hc_pre_lagged(H, pre_own, pre_own)


@toggle("v41_q_head_norm", kernel="q_head_norm", **_B,
        provenance=Provenance(("ik_llama.cpp",), ("V4 graph reused for V4.1",),
                              ("ik_llama.cpp PR #2455",)),
        description="V4's per-head RMS rescale of the query after wq_b kept on V4.1, which "
                    "dropped it: q is divided by its per-head RMS (bf16 arithmetic, as V4's "
                    "reference). ik_llama.cpp PR #2455: keeping it is 'the difference between "
                    "the numbers below and a perplexity of 244'.")
def _q_head_norm(golden, q, eps):
    return golden.q_head_rescale(q, eps)


@toggle("v41_window_kv_v4_grid", kernel="window_kv_store", **_B,
        params=(Param("rope_dims", int, 64, "trailing RoPE dims left in bf16 (64 in V4.1-Flash "
                      "and the tiny config)", min=0),),
        provenance=Provenance(("vllm",), ("V4 window-KV record (584 bytes) on V4.1",),
                              ("vLLM deepseek_v41 fused_compress_quant_cache.py",),
                              "vLLM keeps both records; no V4.1 bug report found"),
        description="Window KV simulated on V4's FP8 grid: only the non-RoPE dims are FP8 "
                    "round-tripped, in 1x64 blocks (ue8m0), and the RoPE tail stays bf16. "
                    "V4.1 quantises all head dims, RoPE tail included, in 1x32 blocks. vLLM "
                    "carries both cache records (584-byte V4, 528-byte V4.1), so a V4.1 layer "
                    "given the V4 record gets this grid.")
def _window_kv_v4_grid(golden, kv, *, rope_dims):
    kv = golden.rs(kv)
    if not golden.quant:
        return kv
    n = kv.shape[-1] - rope_dims
    return torch.cat([Q.fp8_qdq(kv[..., :n], 64).to(golden.cd), kv[..., n:]], -1)


@toggle("v41_fp8_scale_block128", kernel="weight_dequant", **_B,
        provenance=Provenance(("llama.cpp",), ("convert_hf_to_gguf with weight_block_size 128",),
                              ("llama.cpp PR #28696",),
                              "scales recovered as the smallest power of two holding each 32x32 "
                              "block (the ue8m0 rule our writer uses)"),
        description="FP8 weights dequantised with V4's 128x128 block size against V4.1's "
                    "32x32 scale grid: weight[o, i] takes scale[o//128, i//128] of the 32-block "
                    "scale tensor instead of scale[o//32, i//32], so most blocks get another "
                    "block's scale. llama.cpp PR #28696: 'reusing that value rescales every "
                    "dequantized weight without raising'. Applies to every FP8 weight "
                    "(attention, shared expert, Engram wkv), not to the FP4 routed experts.")
def _fp8_scale_block128(golden, w):
    from reference_model.checkpoint_write import encode_fp8
    w = golden.weight_dequant(w)
    codes, scale = encode_fp8(w.float(), 32)
    s = Q.e8m0_to_float(scale)
    out, inp = w.shape
    wrong = s[torch.arange(out) // 128][:, torch.arange(inp) // 128]
    return (codes.float() * wrong).to(w.dtype)


@toggle("v41_stale_index_keys", kernel="index_key_source", **_B,
        provenance=Provenance(("deepseek-inference",), ("inference/model.py @ dba1be0a",),
                              ("transformers PR #48721 (description)",
                               "DeepSeek-V4.1-Flash discussion/PR #12 (proposed fix, not read)")),
        description="DeepSeek's V4.1 reference as written (doc §9 D1): an index source scores "
                    "against one shared key slot that a KV source fills only when it emits "
                    "entries, so on a decode step where a ratio-2 source closes no group its "
                    "indexer reads whatever key cache was published last (the last ratio-1 "
                    "source's, from the step before) as if it were its own. The transformers "
                    "port (#48721) calls it 'the direct ownership defect'; the golden reads "
                    "each source's own keys every step.")
def _stale_index_keys(golden, layer, source, fresh, last_writer):
    if fresh or last_writer is None:
        return golden.index_key_source(layer, source, fresh, last_writer)
    return last_writer


# ---- engines' readings of doc §9 (optimizations) ---------------------------------------------
@toggle("rmsnorm_cast_first", kernel="rms_norm", **_OPT,
        provenance=Provenance(("transformers",), ("DeepseekV3RMSNorm inherited by the V4.1 port",),
                              ("transformers PR #48721 (docs/v41-architecture.md §9 D4)",)),
        description="RMSNorm as transformers' DeepseekV3RMSNorm: the normalised input is cast "
                    "to bf16 first and then multiplied by the weight in bf16 (weight * "
                    "x_hat.to(input_dtype)), one more bf16 rounding than the reference's "
                    "bf16(w_fp32 · x_hat_fp32). Every RMSNorm of the model (attention, FFN, q, "
                    "kv, compressor, index-key and final norms).")
def _rmsnorm_cast_first(golden, x, w, eps, round_out=True):
    y = golden.rs(golden.rms_norm(x, None, eps, round_out=False)) * golden.c(w)
    return golden.rs(y) if round_out else y


@toggle("compressor_norm_fp32", kernels=("compressor_proj1", "compressor_norm"), **_OPT,
        provenance=Provenance(("vllm",), ("deepseek_v41 fused compressor kernel",),
                              ("vLLM deepseek_v41 fused_compress_quant_cache.py "
                               "(kv_score asserted fp32; docs/v41-architecture.md §9 D3)",)),
        description="Compressor as vLLM's fused V4.1 kernel: the ratio-1 wkv projection is "
                    "kept in fp32 (no bf16 store) and cmp_norm normalises the fp32 pooled "
                    "(ratio 2) or projected (ratio 1) value directly, where the reference and "
                    "transformers round it to bf16 before the norm.")
def _compressor_norm_fp32():
    def compressor_proj1(golden, x, wkv):
        return golden.r32(golden.c(x) @ golden.c(wkv).T)

    def compressor_norm(golden, c, norm_w, eps):
        return golden.rms_norm(golden.r32(c), norm_w, eps)

    return {"compressor_proj1": compressor_proj1, "compressor_norm": compressor_norm}


@toggle("compressed_kv_mxfp8", kernel="compressed_kv_store", group="compressed_kv_format", **_OPT,
        provenance=Provenance(("vllm",), ("deepseek_v41 MXFP8 compressed-KV record (528 bytes)",),
                              ("vLLM deepseek_v41 cache layouts (docs/v41-architecture.md §9 D7)",),
                              "which record vLLM picks by default"),
        description="Compressed KV entries stored as MXFP8 (vLLM's 528-byte record): e4m3 "
                    "over all head dims in 1x32 blocks with power-of-two (ue8m0) scales, "
                    "instead of the reference's FP4 e2m1 in 1x16 blocks with E4M3 scales.")
def _compressed_kv_mxfp8(golden, latent_roped):
    x = golden.rs(latent_roped)
    return golden.rs(Q.fp8_qdq(x, 32)) if golden.quant else x


@toggle("compressed_kv_bf16", kernel="compressed_kv_store", group="compressed_kv_format", **_OPT,
        provenance=Provenance(("vllm",), ("deepseek_v41 bf16 compressed-KV rows",),
                              ("vLLM deepseek_v41 cache layouts (docs/v41-architecture.md §9 D7)",)),
        description="Compressed KV entries kept as plain bf16 rows (a vLLM option), with no FP4 "
                    "round trip: more precision than the reference's FP4 e2m1 / E4M3-per-16 "
                    "grid, which its QAT expects.")
def _compressed_kv_bf16(golden, latent_roped):
    return golden.rs(latent_roped)


@toggle("attn_logits_bf16", kernel="sparse_attention", **_OPT,
        provenance=Provenance(("transformers",), ("eager attention",),
                              ("transformers PR #48721 (docs/v41-architecture.md §9 D5)",)),
        description="Attention as transformers' eager path: q·kᵀ as a bf16 matmul (bf16 "
                    "logits) scaled in bf16, the sink appended as a logit, fp32 softmax, the "
                    "normalised probabilities cast to bf16 before P·V. The reference takes "
                    "bf16 q/kv to fp32 logits and rounds the unnormalised probabilities.")
def _attn_logits_bf16(golden, q, kv, sink, idx, scale, phase="prefill"):
    return E.eager_attention(q, kv, sink, idx, scale, golden.rs, golden.cd)


@toggle("candidate_underfill_keep", kernel="candidate_topk", **_B,
        provenance=Provenance(("deepseek-inference",), ("inference/model.py @ dba1be0a",),
                              ("docs/v41-architecture.md §9 D9",
                               "transformers PR #48721 (drops -inf picks)"),
                              "REF's picks outside the candidates follow torch.topk's "
                              "unspecified tie order; here the lowest positions"),
        description="DeepSeek's V4.1 reference when a query's candidate pool holds fewer "
                    "entries than index_topk: top-k over the candidate-masked scores returns "
                    "-inf picks, and REF keeps every pick with j < (t+1)//r, so the query also "
                    "attends to visible entries outside its candidates (here the lowest "
                    "such positions; REF's are torch.topk's unspecified tie order). "
                    "transformers drops -inf picks, as the golden does. Unreachable with the "
                    "released sizes (pool >= 16384 positions, top-k 512).")
def _candidate_underfill_keep(golden, scores, candidates, visible, k):
    picks = golden.candidate_topk(scores, candidates, visible, k)
    c, n = scores.shape
    kept = torch.zeros(c, n, dtype=torch.bool, device=scores.device)
    ok = picks >= 0
    kept[torch.arange(c, device=scores.device).unsqueeze(1).expand_as(picks)[ok], picks[ok]] = True
    j = torch.arange(n, device=scores.device)
    extra = (j.unsqueeze(0) < visible.unsqueeze(1)) & ~kept
    need = (picks < 0).sum(-1, keepdim=True)
    kept |= extra & (extra.cumsum(-1) <= need)
    return topk_lowest_index_ties(torch.zeros_like(scores).masked_fill(~kept, float("-inf")), k)
