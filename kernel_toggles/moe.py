"""Built-in MoE toggles (registered from builtin.py at their place in forward order): how
engines compute the routed experts (where the routing weight is applied, Q8_0 activations),
the routed scaling factor and the router's score function. Facts and provenance as
builtin.py's (docs/research/engine-divergences.md)."""
from __future__ import annotations

import torch

from reference_model import quant as Q

from . import emulate as E
from .registry import Param, Provenance, toggle

_B = dict(_builtin=True)


@toggle("moe_weight_after_w2", kernel="expert_ffn", group="moe_experts", **_B,
        provenance=Provenance(("sglang", "vllm"), ("fused MoE kernels (mul_routed_weight on the "
                                                   "down GEMM)",), (),
                              "per MoE backend (docs/research/dsv4-architecture.md §2.7, §8)"),
        description="Routing weight applied to the fp32 accumulator of the down projection "
                    "(w2) before its bf16 store, as fused MoE kernels do, instead of to the "
                    "SwiGLU intermediate before w2's FP8 activation quantisation as in the "
                    "reference: the FP8 quantiser then sees the unweighted intermediate. "
                    "The shared expert is unaffected.")
def _moe_weight_after_w2(golden, x, w1, w3, w2, weight, limit):
    if weight is None:
        return golden.expert_ffn(x, w1, w3, w2, None, limit)
    cd = golden.cd
    h = golden.rs(golden.swiglu(golden.fp8_linear(x, w1), golden.fp8_linear(x, w3), limit))
    if golden.quant:
        h = Q.fp8_qdq(h, 128).to(cd)
    acc = golden.r32(h @ w2.to(cd).T)
    return golden.rs(acc * golden.r32(weight.to(cd)).unsqueeze(-1))


@toggle("expert_act_q8_0", kernel="expert_ffn", group="moe_experts", engine_arm=False, **_B,
        provenance=Provenance(("llama.cpp",), ("b11434 CPU backend with MXFP4 routed experts (default "
                                                 "for V4 GGUFs)",),
                              ("ggml-cpu quants.c: quantize_row_q8_0, ggml_vec_dot_mxfp4_q8_0",
                               "llama-graph.cpp build_moe_ffn",
                               "docs/real-engines.md: `fidelity llamacpp replay`, isolated MoE")),
        description="llama.cpp's CPU routed experts: their MXFP4 GEMMs read the activations as "
                    "Q8_0 (blocks of 32, scale amax/127 in fp16, codes rounded to nearest-even) "
                    "instead of the reference's FP8 1x128 blocks, for the gate/up input and "
                    "the SwiGLU output alike, and the routing weight multiplies the down "
                    "projection's output (llama.cpp's build_moe_ffn) rather than the SwiGLU "
                    "intermediate. The shared expert (F32/Q8_0 weights there) is unaffected. "
                    "On the exact profile this is llama.cpp's expert arithmetic.")
def _expert_act_q8_0(golden, x, w1, w3, w2, weight, limit):
    if weight is None:
        return golden.expert_ffn(x, w1, w3, w2, None, limit)
    cd = golden.cd
    a = E.q8_0(x, cd)
    h = golden.swiglu(a @ w1.to(cd).T, a @ w3.to(cd).T, limit)
    out = E.q8_0(h, cd) @ w2.to(cd).T
    return golden.rs(out * weight.to(cd).unsqueeze(-1))


def _rsf_recorder(box, route_scale_in_weights: bool):
    def route_weights(golden, scores, idx, bias, route_scale, renormalize=True):
        box["rsf"] = route_scale
        return golden.route_weights(scores, idx, bias,
                                    route_scale if route_scale_in_weights else 1.0, renormalize)
    return route_weights


def _rsf(box):
    if "rsf" not in box:
        raise RuntimeError("moe_combine ran before route_weights: routed scaling factor unknown")
    return box["rsf"]


@toggle("routed_scaling_output_bf16", kernels=("route_weights", "moe_combine"),
        wraps=("route_weights",), **_B,
        params=(Param("mode", str, "mul_then_add", "bf16 epilogue: routed *= rsf then += "
                      "shared, or shared.add_(routed, alpha=rsf)",
                      choices=("mul_then_add", "fused_add")),),
        provenance=Provenance(("sglang",), ("default when rsf is not fused into top-k",
                                            "SGLANG_OPT_MXFP4_FUSE_RSF_SHARED_ADD=1 -> fused_add"),
                              ("sglang deepseek_v2.py forward_normal",)),
        description="Routed scaling factor (1.5) taken out of the fp32 routing weights and "
                    "applied after the expert combine in bf16: the routed sum is stored in "
                    "bf16, multiplied by rsf in bf16 and added to the shared expert in bf16 "
                    "(mode=fused_add: shared.add_(routed, alpha=rsf), one rounding). The "
                    "reference multiplies rsf into the fp32 weights before w2 and adds the "
                    "shared expert in fp32 with a single cast.")
def _routed_scaling_output_bf16(mode):
    box = {}

    def moe_combine(golden, routed_sum, shared):
        return E.rsf_on_output(routed_sum, shared, _rsf(box), mode, golden.cd)

    return {"route_weights": _rsf_recorder(box, False), "moe_combine": moe_combine}


@toggle("routed_scaling_double", kernels=("route_weights", "moe_combine"),
        category="known-bug", wraps=True, **_B,
        provenance=Provenance(("sglang",), ("two-batch overlap epilogue", "KT-EP MXFP4 experts"),
                              ("kvcache-ai/sglang PR #86", "sglang PR #35152",
                               "vllm #24119 (V3)")),
        description="Routed scaling factor applied twice: once in the routing weights and "
                    "again on the routed output (1.5 x 1.5 = 2.25x the routed experts' "
                    "contribution). kvcache-ai/sglang PR #86 (KT-EP MXFP4 experts scaled "
                    "2.25x), sglang PR #35152 (two-batch-overlap epilogue re-applies rsf), "
                    "vLLM #24119 for V3 (GSM8K 0.66 -> 0.95 after the fix).")
def _routed_scaling_double():
    box = {}

    def moe_combine(golden, routed_sum, shared):
        return golden.moe_combine(routed_sum * _rsf(box), shared)

    return {"route_weights": _rsf_recorder(box, True), "moe_combine": moe_combine}


@toggle("router_softplus_logf", kernel="moe_gate", engine_arm=False, **_B,
        provenance=Provenance(("llama.cpp",), ("b11434 CPU backend (sqrtsoftplus gating)",),
                              ("ggml-cpu unary-ops.cpp op_softplus", "llama-graph.cpp build_moe_ffn "
                               "(ffn_moe_logits at GGML_PREC_F32)",
                               "docs/real-engines.md: the twin's router")),
        description="llama.cpp's router scores sqrt(softplus(logit)) with softplus computed in "
                    "float32 as logf(1 + expf(x)) (x itself above 20) instead of the reference's "
                    "log1p form: below a logit of about -16.6 the 1 + e^x rounds to 1 and the "
                    "score is exactly 0, and small scores lose relative precision above that. "
                    "An expert picked for a token (hash layers pick regardless of score) then "
                    "gets weight 0 and the token's other experts its share.")
def _router_softplus_logf(golden, x, w, score_func):
    if score_func != "sqrtsoftplus":
        return golden.moe_gate(x, w, score_func)
    logits = (golden.c(x) @ w.to(golden.cd).T).float()
    soft = torch.where(logits > 20.0, logits, torch.log(1.0 + torch.exp(logits)))
    return soft.sqrt().to(golden.cd)
