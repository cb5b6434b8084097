"""`ModelV41`: the one golden forward (reference_model/model.py) held to DeepSeek-V4.1
configs. V4.1's parts (lagged mHC, sourced attention, Engram, 32x32 GEMMs) are picked by the
config in reference_model/version.py; this name stays for callers that want a V4.1 model
or nothing."""
from __future__ import annotations

from ..model import Model
from .config import V41Config
from .engram_step import EngramVocabularyError, token_map_for
from .sizes import v41_placement
from .state import V41LayerState, V41SequenceState


class ModelV41(Model):
    """Model, refusing a config that is not DeepSeek-V4.1's (use build_model for either)."""

    def __init__(self, weights, numerics=None, **kw):
        if not isinstance(weights.cfg, V41Config):
            raise TypeError(f"ModelV41 runs DeepSeek-V4.1 configs, got {type(weights.cfg).__name__}; "
                            "use reference_model.build_model to pick the class")
        super().__init__(weights, numerics, **kw)


__all__ = ["EngramVocabularyError", "ModelV41", "V41LayerState", "V41SequenceState",
           "token_map_for", "v41_placement"]
