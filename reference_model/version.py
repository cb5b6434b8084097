"""Which parts make a config's model: DeepSeek-V4 and V4.1 are one forward
(reference_model/model.py) whose version-specific pieces are picked here, by the config.

    part        V4                          V4.1
    mhc         PlainHC (own pre, hc_head)  LaggedHC (previous site's pre in the stream)
    attention   V4Attention (own compressor, CSA indexer / HCA)
                                            SourcedAttention (KV / index / candidate sources)
    gemm        Gemm128 (1x128 act quant)   Gemm32 (32x32 weights, 1x32 act quant)
    engram      none                        EngramStep on engram_layer_ids
    placement   placement.model_placement   v41.sizes.v41_placement
Config fields, tensor tables and checkpoint names are the version's modules (config.py /
v41/config.py, specs.py / v41/specs.py, checkpoint_*.py / v41/checkpoint_*.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .attention_v4 import V4Attention
from .gemm import Gemm32, Gemm128
from .mhc import LaggedHC, PlainHC
from .placement import model_placement
from .v41 import is_v41
from .v41.attention import SourcedAttention
from .v41.engram_step import EngramStep
from .v41.sizes import v41_placement


@dataclass(frozen=True)
class Parts:
    name: str
    mhc: type
    attention: type
    gemm: type
    engram: type | None
    placement: Callable
    reference: str                 # the revision of DeepSeek's reference code the golden follows


# What each golden follows, said in every report: DeepSeek's reference code changed after
# release (V4: docs/research/dsv4-architecture.md §1; V4.1: a proposed fix of the index keys)
V4_REFERENCE = ("DeepSeek-V4-Flash inference/ @ 60d8d707 (the current revision: shared-expert "
                "SwiGLU clamped, KV cache FP8 round trip in effect)")
V41_REFERENCE = ("DeepSeek-V4.1-Flash inference/ @ dba1be0a with the index-key fix proposed in its "
                 "PR #12 (each KV source's own keys on every step, docs/v41-architecture.md §9 D1; "
                 "the code as written is the toggle v41_stale_index_keys)")


V4 = Parts("v4", PlainHC, V4Attention, Gemm128, None, model_placement, V4_REFERENCE)
V41 = Parts("v4.1", LaggedHC, SourcedAttention, Gemm32, EngramStep, v41_placement, V41_REFERENCE)


def parts_for(cfg) -> Parts:
    """The parts of the config's version (V4.1 by its config type, else V4)."""
    return V41 if is_v41(cfg) else V4
