"""The V4.1 kernels on the seam (docs/v41-architecture.md §8): each new V4.1 step is a
method of `V41Kernels`, so toggles can replace it by name like any V4 kernel. Defaults are
the reference reading; each delegates to reference_model/v41/kernels.py (pure functions,
hand-tested in tests/test_v41_kernels.py).

Where V4.1 computes what V4 computes, ModelV41 calls V4's kernel of that name (rms_norm,
bf16_linear, rope_inv_freq, rope_apply, window_first, compressed_positions,
compressed_visible, index_weights, index_scores, index_select, index_topk, sparse_attention, wo_a,
hc_post, moe_gate, moe_select, route_weights, swiglu, moe_combine, lm_head, chunk_boundary,
state_restore), so toggles on those act on both versions. The names below are only V4.1's.

`V41Kernels` is the base class of reference_model.numerics.Numerics: one seam for both
versions, so every tool's `Numerics(...)` and every arm's toggled copy serves a V4.1 model."""
from __future__ import annotations

from .. import quant
from . import kernels

# Names of the V4.1 kernels (replaceable by toggles, like numerics.KERNELS).
V41_KERNELS = (
    "fp8_linear32", "weight_dequant", "expert_ffn32", "q_head_norm", "window_kv_store",
    "compressor_proj2", "compressor_pool2", "compressor_proj1", "compressor_norm",
    "compressed_kv_store", "index_key", "index_fp4", "index_key_source", "index_candidates",
    "candidate_topk", "engram_hash", "engram_lookup", "engram_gate", "hc_mix", "hc_pre_lagged",
)
# V4's kernels a V4.1 model calls too (the list above in the module docstring): a toggle on
# one of these acts on both versions, a toggle on any other V4 kernel on V4 only.
V4_KERNELS_SHARED = (
    "rms_norm", "bf16_linear", "rope_inv_freq", "rope_apply", "window_first",
    "compressed_positions", "compressed_visible", "index_weights", "index_scores", "index_select",
    "index_topk", "sparse_attention", "wo_a", "hc_post", "moe_gate", "moe_select", "route_weights", "swiglu",
    "moe_combine", "lm_head", "chat_request", "chat_render", "chunk_boundary", "state_restore",
)


class V41Kernels:
    """DeepSeek-V4.1's kernels (reference reading), methods of every Numerics (its base
    class; they use Numerics' rs / r32 / c / quant / cd / rms_norm / swiglu / bf16_linear)."""

    # ---- GEMMs ----------------------------------------------------------------------------
    def fp8_linear32(self, x, w):
        """FP8/FP4-weight GEMM of V4.1: FP8 act-quant of the bf16 input in 1x32 blocks
        (ue8m0), fp32 accumulate, bf16 out (V4: 1x128). `w` holds dequantised values."""
        return kernels.fp8_linear32(self, x, w)

    def weight_dequant(self, w):
        """An FP8 weight (32x32 E8M0 block scales) as the GEMM sees it: the checkpoint's
        values, already dequantised by the loader (exact in bf16), unchanged. Its own
        kernel so a loader that reads the scales on another grid is a toggle."""
        return w

    def expert_ffn32(self, x, w1, w3, w2, weight, limit):
        """SwiGLU expert as V4's expert_ffn with V4.1's 1x32 activation quantisation: gate/up
        GEMMs, `swiglu` (clamped), routing weight on the fp32 intermediate, w2; bf16 out."""
        h = self.swiglu(self.fp8_linear32(x, w1), self.fp8_linear32(x, w3), limit)
        if weight is not None:
            h = weight.to(self.cd).unsqueeze(-1) * h
        return self.fp8_linear32(self.rs(h), w2)

    # ---- attention ------------------------------------------------------------------------
    def q_head_norm(self, q, eps):
        """V4.1 has no per-head RMS rescale of q after wq_b (V4 had one): identity."""
        return q

    def window_kv_store(self, kv):
        """Window KV after RoPE: FP8 e4m3 round trip of all head dims in 1x32 blocks, ue8m0."""
        return kernels.window_kv_store(self, kv)

    # ---- compressors (KV sources only) ------------------------------------------------------
    def compressor_proj2(self, x, wkv, wgate):
        """Ratio 2: fp32 projections (K, G) of the bf16 input with the bf16 weights."""
        return kernels.compressor_proj2(self, x, wkv, wgate)

    def compressor_pool2(self, K, G, pending=None):
        """Ratio 2: disjoint pairs, per-channel fp32 softmax of G over the pair, Σ w·K.
        Returns (pooled [groups, d] fp32, the open group's rows or None)."""
        return kernels.compressor_pool2(self, K, G, pending)

    def compressor_proj1(self, x, wkv):
        """Ratio 1: a plain bf16 projection per token."""
        return kernels.compressor_proj1(self, x, wkv)

    def compressor_norm(self, c, norm_w, eps):
        """latent = cmp_norm(bf16(c)), before RoPE (doc §9 D3: the REF reading)."""
        return kernels.compressor_norm(self, c, norm_w, eps)

    def compressed_kv_store(self, latent_roped):
        """Compressed KV entry after RoPE: FP4 e2m1 over all dims, 1x16 blocks, E4M3 scales."""
        return kernels.compressed_kv_store(self, latent_roped)

    # ---- indexer ----------------------------------------------------------------------------
    def index_key(self, latent, wk, k_norm_w, eps):
        """Index key of a KV source's entry before RoPE: k_norm(wk(latent)), bf16 GEMM then
        RMSNorm (no Hadamard, no compressor of its own: V4 had both)."""
        return self.rms_norm(self.bf16_linear(latent, wk), k_norm_w, eps)

    def index_fp4(self, x, kind: str):
        """Indexer query (kind 'q') or key ('k') after RoPE: FP4 round trip, 1x32, ue8m0."""
        return self.c(quant.fp4_qdq(self.rs(x), kernels.ACT_BLOCK)) if self.quant else x

    def index_key_source(self, layer: int, source: int, fresh: bool, last_writer):
        """Which KV source's index-key cache layer `layer`'s indexer scores against: its own
        source's, every step (doc §9 D1, reading B). `fresh`: the source emitted keys in
        this step; `last_writer`: the KV source that emitted keys last (REF's shared slot)."""
        return source

    def index_candidates(self, scores, positions, ratio: int, block: int, topk_blocks: int):
        """The candidate source's block mask [c, n] over its visibility-masked scores
        (REF `select_candidate_blocks`)."""
        return kernels.candidate_blocks(scores, positions, ratio, block, topk_blocks)

    def candidate_topk(self, scores, candidates, visible, k: int):
        """Top-k of a layer after the candidate source, inside its candidate positions:
        picks whose score is -inf (outside the candidates, or not visible) are dropped (-1),
        doc §9 D9's HF reading. `visible` [c]: entries j < visible[t] are complete for query
        t (what REF's reading keeps even outside the candidates)."""
        return self.index_topk(scores.masked_fill(~candidates, float("-inf")), k)

    # ---- Engram -----------------------------------------------------------------------------
    def engram_hash(self, hist, positions, layout, pad_c: int):
        """Row ids [s, engram layers, columns] of the positions' n-grams over the compressed
        history `hist` (indexed by absolute position)."""
        return kernels.engram_hash(hist, positions, layout, pad_c)

    def engram_lookup(self, table, ids):
        """Rows of an Engram table (e4m3 · E8M0 per 32 channels) in the compute dtype."""
        return kernels.engram_lookup(self, table, ids)

    def engram_gate(self, H, kv, q_weight, k_weight, eps: float, token_mask=None):
        """H_k += sigmoid(signed-sqrt(normalised key·stream dot)) · value per stream."""
        return kernels.engram_gate(self, H, kv, q_weight, k_weight, eps, token_mask)

    # ---- lagged mHC -------------------------------------------------------------------------
    def hc_mix(self, H, fn, scale, base, cfg):
        """A site's (pre, post, comb) from its input streams (fp32), without the collapse."""
        return kernels.hc_mix(self, H, fn, scale, base, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                           cfg.norm_eps)

    def hc_pre_lagged(self, H, pre_prev, pre_own):
        """The site's input: the streams collapsed with the PREVIOUS site's pre-mix (V4.1's
        lag); `pre_own` (this site's) is what V4 would have used."""
        return kernels.hc_collapse(self, H, pre_prev)


__all__ = ["V41_KERNELS", "V41Kernels", "V4_KERNELS_SHARED"]
