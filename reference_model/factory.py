"""One constructor for either DeepSeek version: `build_model(weights, numerics, **kw)` is
the one Model, whose version parts the config picks (reference_model/version.py)."""
from __future__ import annotations

from .model import Model


def model_class(cfg) -> type:
    """The model class for a config: Model, for V4 and V4.1 alike."""
    return Model


def build_model(weights, numerics=None, **kw):
    """The golden forward for `weights` (any WeightSource), constructed with Model's
    arguments (chunk_tokens, weight_cache, devices, schedule, token_map, ...)."""
    return Model(weights, numerics, **kw)
