"""One constructor for either DeepSeek version: tools build their model with
`build_model(weights, numerics, **kw)` and get V4's Model or V4.1's ModelV41 by the
config's type (reference_model.v41.is_v41), with the same public API either way."""
from __future__ import annotations

from .model import Model
from .v41 import is_v41


def model_class(cfg) -> type:
    """Model for a DeepSeek-V4 ModelConfig, ModelV41 for a V41Config."""
    if is_v41(cfg):
        from .v41.model import ModelV41
        return ModelV41
    return Model


def build_model(weights, numerics=None, **kw):
    """The golden forward for `weights` (any WeightSource): Model or ModelV41, constructed
    with Model's arguments (chunk_tokens, weight_cache, devices, schedule, ...)."""
    return model_class(weights.cfg)(weights, numerics, **kw)
