"""Built-in toggles: the engines' DeepSeek-V4 numerics, one per optimization or known bug.

Rule: a toggle rounds explicitly only where its engine differs; roundings the reference
also does go through golden.rs / golden.r32, so they follow the chosen profile.

Every fact here comes from `docs/research/engine-divergences.md` (§1–§3, §5) and
dsv4-architecture.md (§4, §7, §8); provenance strings cite the section's sources.
Registration order is the canonical order (roughly the order of the forward); where two
toggles touch the same kernel and may be combined, the one registered later wraps the
earlier (e.g. `index_keys_fp8` uses whatever rotation `index_no_hadamard` left)."""
from __future__ import annotations

import torch

from reference_model import quant as Q

from . import emulate as E
from .registry import Param, Provenance, toggle

_B = dict(_builtin=True)


from . import rope as _rope  # noqa: E402,F401  (RoPE toggles: registered here, in forward order)


# ---- KV cache ---------------------------------------------------------------------------
@toggle("kv_fp8_from_fp32", kernel="kv_store", group="kv_cache", **_B,
        provenance=Provenance(("sglang",), ("SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE=0 (default)",),
                              ("sglang PR #31086", "store.cuh fused_store_flashmla_cache")),
        description="SGLang's fused FlashMLA cache store quantises the 448 nope dims of the "
                    "window/compressed KV to e4m3 (1x64 blocks, power-of-two scale "
                    "max(1e-4, amax)/448 rounded up: the reference grid) straight from the "
                    "fp32 RMSNorm output in registers, while the reference first rounds to "
                    "bf16 and quantises the bf16 values. About 4% of elements land in an "
                    "adjacent fp8 bin (PR #31086, which adds "
                    "SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE=1 to match the reference).")
def _kv_fp8_from_fp32(golden, nope):
    return Q.fp8_qdq(E.f32(nope), 64).to(golden.cd)


@toggle("kv_bf16", kernel="kv_store", group="kv_cache", **_B,
        provenance=Provenance(("sglang", "vllm"),
                              ("sglang SGLANG_DSV4_BF16_KV=1 (open PR #33413) / "
                               "--kv-cache-dtype bfloat16",
                               "vllm --attention-backend FLASHINFER_MLA_SPARSE_DSV4 "
                               "--kv-cache-dtype auto"),
                              ("sglang PR #33413",)),
        description="KV latent stored as plain bf16 with no FP8 round trip of the nope dims. "
                    "The reference simulates its fp8 KV cache (QAT) on exactly those dims, so "
                    "keeping more precision is a divergence too: SGLang's open PR #33413 "
                    "(SGLANG_DSV4_BF16_KV), bfloat16 KV on NPU, and vLLM's FlashInfer DSV4 "
                    "backend with kv-cache-dtype auto/bfloat16.")
def _kv_bf16(golden, nope):
    return golden.rs(nope)


@toggle("kv_nvfp4", kernel="kv_store", group="kv_cache", **_B,
        params=(Param("global_scale", float, 1.0, "the layer's fp32 global scale (calibrated in "
                      "the engine; values of order 1 make 1.0 exact)"),),
        provenance=Provenance(("freetoken",), ("FreeToken v0.2.3 kv-cache dtype nvfp4_ds_mla",),
                              ("FlashML-org/FreeToken release v0.2.3 (#920)",
                               "eugr/spark-vllm-docker#331 (a 4-bit KV recipe)",
                               "UNCONFIRMED: the release notes name the dtype, not its kernel; "
                               "modelled on NVFP4's own layout")),
        description="A 4-bit KV cache (FreeToken's nvfp4_ds_mla, to reach 1M tokens on small GPUs): "
                    "the 448 nope dims of the window/compressed KV stored as NVFP4 -- e2m1 values "
                    "in 1x16 blocks with an e4m3 block scale and one fp32 global scale -- where "
                    "the reference keeps e4m3 in 1x64 blocks (fp8_ds_mla); the bf16 value is "
                    "quantised, as fp8_ds_mla does, and the 64 RoPE dims stay bf16.")
def _kv_nvfp4(golden, nope, global_scale=1.0):
    return Q.nvfp4_qdq(golden.rs(nope), 16, global_scale).to(golden.cd)


@toggle("kv_cache_ggml", kernels=("kv_store", "rope_apply", "index_key_store", "sparse_attention"),
        group="kv_cache", wraps=True, versions=("v4",), engine_arm=False, **_B,
        params=(Param("type", str, "f16", "llama.cpp's -ctk/-ctv cache type", choices=("f16", "q8_0")),
                Param("rotate", bool, True, "a quantised cache is stored Hadamard-rotated "
                      "(LLAMA_ATTN_ROT_DISABLE=1 turns it off)")),
        provenance=Provenance(("llama.cpp",), ("b11434 -ctk/-ctv f16 (default)", "-ctk q8_0 -ctv q8_0",
                                               "LLAMA_ATTN_ROT_DISABLE=1"),
                              ("llama-kv-cache-dsv4.cpp (one type_k for the window, CSA, HCA and "
                               "indexer caches)", "llama-kv-cache.cpp attention rotation (PR #21038)",
                               "ggml-cpu ops.cpp flash_attn_ext: the query in K's vec_dot type")),
        description="llama.cpp's DeepSeek-V4 caches hold whole KV rows in the -ctk type: the window "
                    "KV, the CSA and HCA compressed entries (no-RoPE and RoPE dims alike) and the "
                    "indexer keys, f16 by default or Q8_0 (blocks of 32, fp16 scale) with -ctk "
                    "q8_0, where the reference keeps an FP8 grid on the no-RoPE dims and bf16 "
                    "elsewhere. Every cached value passes through that type, the tokens of the "
                    "current batch too. With a quantised type the attention rows are first "
                    "rotated by an orthonormal Walsh-Hadamard matrix over the head (the largest "
                    "power of two dividing it, 512 on the released model) and stored rotated; "
                    "the query is rotated alike and the output rotated back (rotate=false: "
                    "LLAMA_ATTN_ROT_DISABLE=1), and ggml's CPU flash attention converts the "
                    "query to Q8_0 before Q.K. On the reference profile f16 holds its bf16 and "
                    "FP8 values exactly; the exact profile's fp32 rows are rounded. With an f16 "
                    "cache a decode step (one query: ggml's one-query path) also converts the "
                    "query to f16 and accumulates P.V online in an f16 buffer, keys in cache "
                    "order, the sink last (prefill's tiled path is fp32). Not modelled: the "
                    "split-KV variant of that path, which ggml takes once the cache view reaches "
                    "512 cells (per-thread chunks merged in fp32).")
def _kv_cache_ggml(type, rotate):
    rotated = type == "q8_0" and rotate

    def cache(x, cd):
        return x.to(torch.float16).to(cd) if type == "f16" else E.q8_0(x, cd)

    def kv_store(golden, nope):
        out = golden.kv_store(nope)
        return out if rotated else cache(out, golden.cd)

    def rope_apply(golden, x, inv, pos, site, inverse=False, phase="prefill"):
        out = golden.rope_apply(x, inv, pos, site, inverse, phase)
        return cache(out, golden.cd) if site in ("kv", "compressed_kv") and not rotated else out

    def index_key_store(golden, k):
        return cache(golden.index_key_store(k), golden.cd)

    def sparse_attention(golden, q, kv, sink, idx, scale, phase="prefill"):
        if type == "f16" and phase == "decode":                 # ggml's one-query path
            return E.ggml_one_query_attention(q, kv, sink, idx, scale).to(golden.cd)
        if type == "f16":                   # rows already stored in f16; Q.K in fp32 (tiled path)
            return golden.sparse_attention(q, kv, sink, idx, scale, phase)
        if not rotated:                     # rows already stored in Q8_0
            return golden.sparse_attention(cache(q, golden.cd), kv, sink, idx, scale, phase)
        h = E.attention_rotation(kv.shape[-1], kv.device)
        out = golden.sparse_attention(cache(E.rotate(q, h), golden.cd), cache(E.rotate(kv, h), golden.cd),
                                      sink, idx, scale, phase)
        return E.rotate(out, h).to(out.dtype)

    return {"kv_store": kv_store, "rope_apply": rope_apply, "index_key_store": index_key_store,
            "sparse_attention": sparse_attention}


# ---- compressor ---------------------------------------------------------------------------
@toggle("compress_state_bf16", kernel="compress_state", **_B,
        provenance=Provenance(("sglang",), ("SGLANG_DSV4_COMPRESS_STATE_DTYPE=bf16",),
                              ("sglang PR #28620 (SM89 recipes)",),
                              "whether prefill rows also pass through the state buffer"),
        description="Compressor kv/score rows (score with the position bias ape added) held "
                    "in a bf16 state buffer instead of fp32 before gated pooling, as SM89 "
                    "recipes set with SGLANG_DSV4_COMPRESS_STATE_DTYPE=bf16. Applied to every "
                    "projected row, i.e. assuming the engine pools from its state buffer in "
                    "prefill as well as decode.")
def _compress_state_bf16(golden, kv, score):
    return E.bf16(kv, golden.cd), E.bf16(score, golden.cd)


# ---- lightning indexer --------------------------------------------------------------------
@toggle("index_no_hadamard", kernel="index_rotate", group="index_rotation",
        category="known-bug", **_B,
        provenance=Provenance(("vllm",), ("default FP8 and MXFP4 indexer",),
                              ("vLLM PR #55459 (fix, open)",)),
        description="Indexer q and k quantised without the Hadamard rotation. vLLM's fused "
                    "indexer kernels never apply it (the `rotate` argument is stored but "
                    "unread), so the FP4/FP8 grids see unrotated, outlier-heavy vectors; the "
                    "dot product is unchanged in exact arithmetic but the quantisation error "
                    "is ~4-5x larger (PR #55459). Combine with index_keys_fp8(scale=pow2) for "
                    "vLLM's default FP8 indexer.")
def _no_hadamard(golden, x, kind):
    return x.to(golden.cd)


@toggle("index_hadamard_q_only", kernel="index_rotate", group="index_rotation",
        category="known-bug", **_B,
        provenance=Provenance(("atom",), (), ("ROCm/ATOM #1507",)),
        description="Hadamard applied to the indexer query but not to the compressed keys, so "
                    "scores are (Hq)·k instead of (Hq)·(Hk) = q·k: the indexer no longer "
                    "measures query-key similarity. ROCm/ATOM #1507: an index_topk=1024 "
                    "indexer could not recall verbatim lines from ~18k-token prompts.")
def _hadamard_q_only(golden, x, kind):
    return x.to(golden.cd) if kind == "k" else golden.index_rotate(x, kind)


@toggle("index_scores_fp32", kernel="index_scores", **_B,
        provenance=Provenance(("sglang", "vllm"), ("DeepGEMM fp8_paged_mqa_logits (default)",),
                              ("vLLM PR #52696",)),
        description="Indexer logits computed and kept in fp32 (per-head dot products, ReLU, "
                    "head weights, head sum) instead of the reference's bf16 rounding at each "
                    "step. Every engine reader (DeepGEMM MQA logits, TileLang, Triton) emits "
                    "fp32; it removes the many exact bf16 ties near the top-k cut and so "
                    "changes which compressed entries are selected.")
def _index_scores_fp32(golden, q, keys, w):
    cd = golden.cd
    r32 = golden.r32
    dots = r32(torch.einsum("chd,nd->chn", q.to(cd), keys.to(cd)))
    per_head = r32(dots.relu() * w.to(cd).unsqueeze(-1))
    return r32(per_head.sum(1))


@toggle("index_keys_fp8", kernels=("index_query", "index_key_store", "index_weights",
                                   "index_scores", "index_fp4"),
        group="index_key_format", subsumes=("index_scores_fp32",), **_B,
        params=(Param("scale", str, "fp32", "per-token scale format: plain fp32 amax/448 "
                      "(SGLang) or rounded up to a power of two (vLLM)", choices=("fp32", "pow2")),),
        provenance=Provenance(("sglang", "vllm"),
                              ("sglang default (no --enable-deepseek-v4-fp4-indexer)",
                               "vllm default (no use_fp4_indexer_cache)",
                               "vllm deepseek_v41 use_fp4_cache=False"),
                              ("sglang store.cuh fused_store_indexer_cache", "sglang PR #26209",
                               "vllm fused_compress_quant_cache.py",
                               "vllm deepseek_v41 indexer_k_store.py (docs/v41-architecture.md §9 D8)"),
                              "SGLang K-scale format after April 2026"),
        description="FP8 indexer (SGLang's default): after the Hadamard rotation the key is "
                    "rounded to bf16 and stored as 128 e4m3 codes plus one fp32 scale per "
                    "token (block 128 = the whole head, scale max(1e-4, amax)/448, not a "
                    "power of two); the query is quantised the same way per (token, head) and "
                    "its scale folded into the head weights in fp32 (the weights_proj output "
                    "times softmax_scale·n_heads^-0.5 is kept fp32, not rounded to bf16); "
                    "logits are fp32: per head "
                    "relu(q8·K8) times the folded weight, summed over heads, times the key "
                    "scale. The reference uses a finer-grained FP4 grid (1x32, ue8m0) and bf16 "
                    "scores. scale='pow2' gives vLLM's variant. Its logits are fp32, so it "
                    "includes index_scores_fp32. On DeepSeek-V4.1 (no Hadamard) it replaces "
                    "the FP4 index keys and queries the same way: vLLM's deepseek_v41 with "
                    "use_fp4_cache=False (docs/v41-architecture.md §9 D8).")
def _index_keys_fp8(scale):
    def fp8_rows(golden, x):
        codes, s = E.fp8_token_quant(golden.rs(x), scale)
        return E.pack_codes(codes, s, golden.cd)                          # [..., d+1]

    def index_query(golden, q):
        return fp8_rows(golden, golden.index_rotate(q, "q"))

    def index_key_store(golden, k):
        return fp8_rows(golden, golden.index_rotate(k, "k"))

    def index_fp4(golden, x, kind):
        return fp8_rows(golden, x)

    def index_weights(golden, w, c):
        return E.f32(w.to(golden.cd) * c)

    def index_scores(golden, q, keys, w):
        qc, qs = E.unpack_codes(q)
        kc, ks = E.unpack_codes(keys)
        return E.fp8_index_logits(qc, qs, kc, ks, w, golden.cd)

    return {"index_query": index_query, "index_key_store": index_key_store,
            "index_weights": index_weights, "index_scores": index_scores, "index_fp4": index_fp4}


@toggle("index_keys_bf16", kernels=("index_query", "index_key_store"),
        group="index_key_format", **_B,
        params=(Param("query", bool, False, "also keep the query in bf16 (no FP4 QDQ)"),),
        provenance=Provenance(("mini-sglang",), ("flat bf16 indexer cache (default)",
                                                 "MINISGL_DSV4_SM80_INDEXER_BF16"),
                              ("MINI target07_fp8_cache_indexer_precision",),
                              "whether the port simulates FP4 anywhere"),
        description="Indexer keys kept in bf16 after the Hadamard rotation, with no FP4 e2m1 "
                    "round trip: more precision than the reference, whose QAT expects the "
                    "1x32 ue8m0 FP4 grid, and therefore a different top-k near ties "
                    "(Mini-SGLang's default flat bf16 indexer cache). query=true also skips "
                    "the query's FP4 round trip.")
def _index_keys_bf16(query):
    def index_query(golden, q):
        if not query:
            return golden.index_query(q)
        return golden.rs(golden.index_rotate(q, "q"))

    def index_key_store(golden, k):
        return golden.rs(golden.index_rotate(k, "k"))

    return {"index_query": index_query, "index_key_store": index_key_store}


# ---- attention ---------------------------------------------------------------------------
@toggle("splitk_decode", kernel="sparse_attention", phase="decode", **_B,
        params=(Param("splits", int, 4, "number of key splits", min=1),
                Param("partials", str, "bf16", "dtype the per-split outputs are stored in",
                      choices=("bf16", "fp32"))),
        provenance=Provenance(("sglang", "vllm", "mini-sglang"),
                              ("sglang SGLANG_HACK_FLASHMLA_BACKEND (FlashMLA split KV)",
                               "vllm VLLM_TRITON_MLA_SPARSE (two-subset merge)",
                               "MINISGL_DSV4_SM80_SPARSE_SPLITK_BF16"),
                              ("MINI target07_bf16_sparse_decode_splitk",),
                              "partial-output dtype of FlashMLA/TileLang and vLLM's merge buffer"),
        description="Split-K sparse decode attention: the selected rows are cut into `splits` "
                    "chunks; each chunk computes fp32 scores, its own running max, bf16 "
                    "probabilities times V with fp32 accumulation, and a normalised partial "
                    "output stored in bf16 (partials=fp32 keeps it fp32) with its "
                    "log-sum-exp; partials are merged in fp32 with the attention sink added "
                    "once to the merged denominator. The reference does one pass over all "
                    "rows. Decode steps only; prefill falls back to the golden kernel.")
def _splitk_decode(golden, q, kv, sink, idx, scale, phase="prefill", *, splits, partials):
    if phase != "decode":
        return golden.sparse_attention(q, kv, sink, idx, scale, phase)
    cd = golden.cd
    return E.splitk_attention(q, kv, sink, idx, scale, splits, cd, round_p=golden.rs,
                              round_partial=E.bf16 if partials == "bf16" else golden.r32,
                              round_out=golden.rs)


@toggle("wo_a_fp8", kernel="wo_a", **_B,
        params=(Param("pow2", bool, True, "power-of-two (ue8m0) activation scales"),),
        provenance=Provenance(("sglang", "vllm"),
                              ("SGLANG_OPT_FP8_WO_A_GEMM=1 (default since mid 2026)",
                               "vllm DeepGEMM fp8_einsum (default)"),
                              ("sglang #39193",),
                              "activation scale format per architecture"),
        description="The grouped wo_a projection run as an FP8 GEMM: the attention output is "
                    "quantised per token in 1x128 groups to e4m3 and multiplied with the fp8 "
                    "checkpoint weight (DeepGEMM fp8_einsum, fp32 accumulate, bf16 out). The "
                    "reference dequantises wo_a and runs a bf16 einsum with no activation "
                    "quantisation. pow2=false uses plain fp32 activation scales.")
def _wo_a_fp8(golden, o, w, *, pow2):
    cd = golden.cd
    oq = Q.fp8_qdq(o, 128, pow2=pow2)
    return golden.rs(torch.einsum("cgd,grd->cgr", oq.to(cd), w.to(cd)))


# ---- mHC ---------------------------------------------------------------------------------
@toggle("mhc_tf32", kernels=("hc_pre", "hc_head"), group="mhc", wraps=True, **_B,
        params=(Param("rounding", str, "truncate", "how fp32 weights become TF32",
                      choices=("truncate", "nearest")),),
        provenance=Provenance(("sglang", "vllm"),
                              ("SGLANG_OPT_DEEPGEMM_HC_PRENORM=1 (default)",
                               "vllm TileLang mHC (TF32)"),
                              ("DeepGEMM tf32_hc_prenorm_gemm", "SM120 RUN.md"),
                              "whether hc_head uses the same GEMM"),
        description="mHC mixing GEMM with the fp32 mixing weights truncated to TF32 (10 "
                    "mantissa bits), as DeepGEMM's tf32_hc_prenorm_gemm does (bf16 stream "
                    "input, exact in TF32; fp32 accumulate and square-sum). The reference "
                    "runs a true fp32 GEMM. Applied to the block mixes and the head's "
                    "collapse mix; Sinkhorn, post and comb stay fp32.")
def _mhc_tf32(rounding):
    def hc_pre(golden, H, fn, scale, base, cfg):
        return golden.hc_pre(H, E.tf32(fn, rounding), scale, base, cfg)

    def hc_head(golden, H, fn, scale, base, cfg):
        return golden.hc_head(H, E.tf32(fn, rounding), scale, base, cfg)

    return {"hc_pre": hc_pre, "hc_head": hc_head}


@toggle("mhc_bf16", kernels=("hc_pre", "hc_head"), group="mhc", wraps=True, **_B,
        provenance=Provenance(("mini-sglang",), ("MINISGL_DSV4_SM80_HC",),
                              ("MINI target07_hc_elementwise_graph_cleanup", "Mirage PR #677")),
        description="mHC pre GEMM with bf16-cached mixing weights (bf16 x bf16, fp32 "
                    "accumulate: linear_bf16_fp32) and the post/comb mixing coefficients kept "
                    "in bf16 after Sinkhorn, where the reference and vLLM use fp32 weights and "
                    "fp32 post/comb. The head's collapse mix uses the bf16 weights too.")
def _mhc_bf16():
    def hc_pre(golden, H, fn, scale, base, cfg):
        x, post, comb = golden.hc_pre(H, fn.to(torch.bfloat16), scale, base, cfg)
        return x, E.bf16(post), E.bf16(comb)

    def hc_head(golden, H, fn, scale, base, cfg):
        return golden.hc_head(H, fn.to(torch.bfloat16), scale, base, cfg)

    return {"hc_pre": hc_pre, "hc_head": hc_head}


from . import moe as _moe  # noqa: E402,F401  (MoE toggles: registered here, in forward order)


# ---- GEMMs -------------------------------------------------------------------------------
@toggle("bf16_gemm_input", kernels=("bf16_linear", "compressor_proj", "moe_gate", "lm_head"),
        wraps=True, versions=("v4",), engine_arm=False, **_B,
        provenance=Provenance(("llama.cpp",), ("b11434 DeepSeek-V4 GGUFs (convert_hf_to_gguf keeps "
                                                 "these weights BF16)",),
                              ("ggml-cpu ggml_compute_forward_mul_mat: src1 converted to the "
                               "weight's vec_dot_type (BF16 for BF16 weights)",
                               "docs/real-engines.md: the twin's router and CSA entries")),
        description="llama.cpp's GEMMs whose weights the GGUF keeps in BF16 -- the indexer's "
                    "weights_proj, the CSA and indexer compressors' kv/gate projections, the "
                    "router and the output head -- read their fp32 activations rounded to bf16 "
                    "(ggml converts the input to the weight's dot-product type), then accumulate "
                    "in fp32. The reference feeds them bf16 values too, so on the reference "
                    "profile this changes nothing; on the exact profile (llama.cpp's) it is the "
                    "one rounding llama.cpp keeps on these paths.")
def _bf16_gemm_input():
    def bf16_linear(golden, x, w):
        return golden.bf16_linear(E.bf16(x), w)

    def compressor_proj(golden, x, wkv, wgate):
        return golden.compressor_proj(E.bf16(x), wkv, wgate)

    def moe_gate(golden, x, w, score_func):
        return golden.moe_gate(E.bf16(x), w, score_func)

    def lm_head(golden, x, w):
        return golden.lm_head(E.bf16(x), w)

    return {"bf16_linear": bf16_linear, "compressor_proj": compressor_proj, "moe_gate": moe_gate,
            "lm_head": lm_head}


# ---- head ---------------------------------------------------------------------------------
@toggle("lm_head_bf16", kernel="lm_head", **_B,
        provenance=Provenance(("sglang", "vllm"), ("sglang default (no --enable-fp32-lm-head)",),
                              (), "vLLM: no fp32 lm_head flag found"),
        description="LM head as a bf16 GEMM (bf16 weight, fp32 accumulate) whose logits are "
                    "stored in bf16 and upcast later, instead of the reference's fp32 head "
                    "with fp32 logits; SGLang's default unless --enable-fp32-lm-head.")
def _lm_head_bf16(golden, x, w):
    out = golden.lm_head(x[:0], w)                       # golden's logits dtype, no compute
    return E.bf16(x.to(golden.cd) @ w.to(golden.cd).T).to(out.dtype)


from . import hisa as _hisa  # noqa: E402,F401  (mlx-vlm's approximate indexer selection)
from . import index_topk as _index_topk  # noqa: E402,F401  (an engine's own index_topk)
from . import v41 as _v41  # noqa: E402,F401  (DeepSeek-V4.1 toggles: V4.1 kernels only)
from . import request as _request  # noqa: E402,F401  (request-level toggles, registered last)
from . import serving as _serving  # noqa: E402,F401  (serving-state toggles)
from . import speculative as _speculative  # noqa: E402,F401  (speculative-decoding toggles)
