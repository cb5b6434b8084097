"""The V4.1 kernels on the seam (docs/v41-architecture.md §8): each new V4.1 step is a
method of `V41Kernels`, so toggles can replace it by name like any V4 kernel. Defaults are
the reference reading; each delegates to reference_model/v41/kernels.py (pure functions,
hand-tested in tests/test_v41_kernels.py).

Where V4.1 computes what V4 computes, ModelV41 calls V4's kernel of that name (rms_norm,
bf16_linear, rope_inv_freq, rope_apply, window_first, compressed_positions,
compressed_visible, index_weights, index_scores, index_topk, sparse_attention, wo_a,
hc_post, moe_gate, moe_select, route_weights, swiglu, moe_combine, lm_head, chunk_boundary,
state_restore), so toggles on those act on both versions. The names below are only V4.1's.

`V41Kernels` is a mixin: Numerics inherits it (one seam for both versions, so every tool's
`Numerics(...)` and every arm's toggled copy serves a V4.1 model too). `as_v41(nx)` gives a
Numerics these methods when it has not got them yet."""
from __future__ import annotations

# Names of the V4.1 kernels (replaceable by toggles, like numerics.KERNELS).
V41_KERNELS = (
    "fp8_linear32", "weight_dequant", "expert_ffn32", "q_head_norm", "window_kv_store",
    "compressor_proj2", "compressor_pool2", "compressor_proj1", "compressor_norm",
    "compressed_kv_store", "index_key", "index_fp4", "index_key_source", "index_candidates",
    "engram_hash", "engram_lookup", "engram_gate", "hc_mix", "hc_pre_lagged",
)


def _all_kernels() -> frozenset:
    from ..numerics import KERNELS
    return frozenset(KERNELS) | frozenset(V41_KERNELS)


def _K():
    """v41/kernels.py, imported on first use (it imports reference_model.numerics, which
    inherits this mixin: importing it here at module level would be circular)."""
    from . import kernels
    return kernels


class V41Kernels:
    """DeepSeek-V4.1's kernels (reference reading). Needs Numerics' rs / r32 / c / quant /
    cd / rms_norm / swiglu / with_kernels from the class it is mixed into."""

    def with_kernels(self, label: str = "custom", _top: list | None = None, **fns):
        """Numerics.with_kernels for V4 and V4.1 kernel names alike (interim, while
        numerics.KERNELS lists V4's only; shadowed once Numerics inherits this mixin and
        lists both): V4 names go through Numerics', V4.1 names are bound here the same way
        (`golden` = the previous implementation of the replaced kernel, the arm's final
        one of every other)."""
        own = {k: f for k, f in fns.items() if k in V41_KERNELS}
        new = super().with_kernels(label, _top, **{k: f for k, f in fns.items() if k not in own})
        if not own:
            return new
        top = _top if _top is not None else [new]
        below = _Below41(self, top, frozenset(own))
        for name, fn in own.items():
            def bound(*a, _fn=fn, **k):
                return _fn(below, *a, **k)
            setattr(new, name, bound)
            new.replaced[name] = label
        return new

    # ---- GEMMs ----------------------------------------------------------------------------
    def fp8_linear32(self, x, w):
        """FP8/FP4-weight GEMM of V4.1: FP8 act-quant of the bf16 input in 1x32 blocks
        (ue8m0), fp32 accumulate, bf16 out (V4: 1x128). `w` holds dequantised values."""
        return _K().fp8_linear32(self, x, w)

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
        return _K().window_kv_store(self, kv)

    # ---- compressors (KV sources only) ------------------------------------------------------
    def compressor_proj2(self, x, wkv, wgate):
        """Ratio 2: fp32 projections (K, G) of the bf16 input with the bf16 weights."""
        return _K().compressor_proj2(self, x, wkv, wgate)

    def compressor_pool2(self, K, G, pending=None):
        """Ratio 2: disjoint pairs, per-channel fp32 softmax of G over the pair, Σ w·K.
        Returns (pooled [groups, d] fp32, the open group's rows or None)."""
        return _K().compressor_pool2(self, K, G, pending)

    def compressor_proj1(self, x, wkv):
        """Ratio 1: a plain bf16 projection per token."""
        return _K().compressor_proj1(self, x, wkv)

    def compressor_norm(self, c, norm_w, eps):
        """latent = cmp_norm(bf16(c)), before RoPE (doc §9 D3: the REF reading)."""
        return _K().compressor_norm(self, c, norm_w, eps)

    def compressed_kv_store(self, latent_roped):
        """Compressed KV entry after RoPE: FP4 e2m1 over all dims, 1x16 blocks, E4M3 scales."""
        return _K().compressed_kv_store(self, latent_roped)

    # ---- indexer ----------------------------------------------------------------------------
    def index_key(self, latent, wk, k_norm_w, eps):
        """Index key of a KV source's entry before RoPE: k_norm(wk(latent)), bf16 GEMM then
        RMSNorm (no Hadamard, no compressor of its own: V4 had both)."""
        return self.rms_norm(self.bf16_linear(latent, wk), k_norm_w, eps)

    def index_fp4(self, x, kind: str):
        """Indexer query (kind 'q') or key ('k') after RoPE: FP4 round trip, 1x32, ue8m0."""
        from .. import quant as Q
        return self.c(Q.fp4_qdq(self.rs(x), _K().ACT_BLOCK)) if self.quant else x

    def index_key_source(self, layer: int, source: int, fresh: bool, last_writer):
        """Which KV source's index-key cache layer `layer`'s indexer scores against: its own
        source's, every step (doc §9 D1, reading B). `fresh`: the source emitted keys in
        this step; `last_writer`: the KV source that emitted keys last (REF's shared slot)."""
        return source

    def index_candidates(self, scores, positions, ratio: int, block: int, topk_blocks: int):
        """The candidate source's block mask [c, n] over its visibility-masked scores
        (REF `select_candidate_blocks`)."""
        return _K().candidate_blocks(scores, positions, ratio, block, topk_blocks)

    # ---- Engram -----------------------------------------------------------------------------
    def engram_hash(self, hist, positions, layout, pad_c: int):
        """Row ids [s, engram layers, columns] of the positions' n-grams over the compressed
        history `hist` (indexed by absolute position)."""
        return _K().engram_hash(hist, positions, layout, pad_c)

    def engram_lookup(self, table, ids):
        """Rows of an Engram table (e4m3 · E8M0 per 32 channels) in the compute dtype."""
        return _K().engram_lookup(self, table, ids)

    def engram_gate(self, H, kv, q_weight, k_weight, eps: float, token_mask=None):
        """H_k += sigmoid(signed-sqrt(normalised key·stream dot)) · value per stream."""
        return _K().engram_gate(self, H, kv, q_weight, k_weight, eps, token_mask)

    # ---- lagged mHC -------------------------------------------------------------------------
    def hc_mix(self, H, fn, scale, base, cfg):
        """A site's (pre, post, comb) from its input streams (fp32), without the collapse."""
        return _K().hc_mix(self, H, fn, scale, base, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                           cfg.norm_eps)

    def hc_pre_lagged(self, H, pre_prev, pre_own):
        """The site's input: the streams collapsed with the PREVIOUS site's pre-mix (V4.1's
        lag); `pre_own` (this site's) is what V4 would have used."""
        return _K().hc_collapse(self, H, pre_prev)


class _Below41:
    """`golden` for a V4.1 kernel replacement (numerics._Below's rule): the replaced
    kernels as they were before it, every other kernel as the finished arm has it."""

    def __init__(self, prev, top: list, own: frozenset):
        self._prev, self._top, self._own = prev, top, own

    def __getattr__(self, name):
        if self._top and name in _all_kernels():
            final = self._top[0]
            if name not in self._own:
                return getattr(final, name)
            if name not in vars(self._prev):           # golden's own implementation
                return getattr(type(self._prev), name).__get__(final)
        return getattr(self._prev, name)


_CLASSES: dict[type, type] = {}


def as_v41(nx):
    """`nx` with the V4.1 kernels: itself when its class has them (Numerics inherits
    V41Kernels), else a copy of the same profile and replaced kernels whose class adds them."""
    if isinstance(nx, V41Kernels):
        return nx
    base = type(nx)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"V41{base.__name__}", (V41Kernels, base), {})
    new = cls.__new__(cls)
    new.__dict__.update(nx.__dict__)
    return new


def has_v41_kernels(nx) -> bool:
    return all(callable(getattr(nx, k, None)) for k in V41_KERNELS)


__all__ = ["V41_KERNELS", "V41Kernels", "as_v41", "has_v41_kernels"]
