"""Engine-side choices of the indexer's top-k: keeping more (or fewer) compressed entries per
row than the config's `index_topk`, and which entries tied at the boundary are kept. Forks raise it for long context
(local-inference-lab/vllm#776: 1024 or 2048 where DeepSeek-V4-Flash ships 512); attention then
reads rows the reference never reads, so outputs move without any kernel being wrong. The
golden keeps the config's value; this toggle is the engine's. Registered from builtin.py beside
the other indexer toggles."""
from __future__ import annotations

from reference_model.primitives import topk_highest_index_ties

from .registry import Param, Provenance, toggle


@toggle("index_topk_override", kernel="index_select", category="optimization", wraps=True, engine_arm=False,
        versions=("v4",), _builtin=True,
        params=(Param("topk", int, 1024, "entries each row keeps (the checkpoint's is its config's index_topk)",
                      min=1),),
        provenance=Provenance(("vllm",), ("local-inference-lab/vllm fork: index_topk raised to 1024 / 2048",),
                              ("local-inference-lab/vllm#776",),
                              "a fork's setting, not an upstream default"),
        description="The indexer keeps `topk` compressed entries per row instead of the checkpoint's "
                    "index_topk: the exact scores, a longer (or shorter) top-k, attention over every "
                    "picked row. A departure from the model's constants, not from its arithmetic.")
def _index_topk_override(golden, q, keys, wts, visible, k, *, topk):
    return golden.index_select(q, keys, wts, visible, min(topk, keys.shape[0]))


@toggle("index_topk_tie_break", kernel="index_topk", category="optimization", engine_arm=False, _builtin=True,
        params=(Param("mode", str, "large", "which of the entries tied at the top-k boundary are kept "
                      "(small: the reference's own rule)", choices=("large", "small")),),
        provenance=Provenance(("sglang",), ("--dsa-topk-backend flashinfer with "
                                            "SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK",),
                              ("flashinfer-ai/flashinfer#3095 (configurable tie_break: SMALL / LARGE)",
                               "flashinfer-ai/flashinfer#4295 (tie_break decides the boundary set)",
                               "sgl-project/sglang#22851"),
                              "UNCONFIRMED: the env var's value spelling, and whether V4's indexer "
                              "takes the DSA top-k backend"),
        description="Entries whose scores tie at the top-k boundary are kept from the larger index "
                    "(FlashInfer's tie_break LARGE) where the reference keeps the smaller ones: the "
                    "same scores, another set only where the k-th score is tied. The `tie-order` "
                    "floor measures the same order; as a toggle it is an engine's setting to A/B.")
def _index_topk_tie_break(golden, scores, k, *, mode):
    return topk_highest_index_ties(scores, k) if mode == "large" else golden.index_topk(scores, k)
