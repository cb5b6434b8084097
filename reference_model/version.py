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


V4 = Parts("v4", PlainHC, V4Attention, Gemm128, None, model_placement)
V41 = Parts("v4.1", LaggedHC, SourcedAttention, Gemm32, EngramStep, v41_placement)


def parts_for(cfg) -> Parts:
    """The parts of the config's version (V4.1 by its config type, else V4)."""
    return V41 if is_v41(cfg) else V4
