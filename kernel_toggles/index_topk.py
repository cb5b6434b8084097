"""Engine-side constants that depart from the checkpoint's: the indexer keeping more (or fewer)
compressed entries per row than the config's `index_topk`. Forks raise it for long context
(local-inference-lab/vllm#776: 1024 or 2048 where DeepSeek-V4-Flash ships 512); attention then
reads rows the reference never reads, so outputs move without any kernel being wrong. The
golden keeps the config's value; this toggle is the engine's. Registered from builtin.py beside
the other indexer toggles."""
from __future__ import annotations

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
