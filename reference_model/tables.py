"""The tensor table of a config's version: reference_model/specs.py (DeepSeek-V4) or
v41/specs.py (V4.1). Code that serves both versions (weights, placement, loaders) asks here."""
from __future__ import annotations

from . import specs as v4_specs
from .v41 import is_v41
from .v41 import specs as v41_specs


def table(cfg):
    """The specs module of the config's version."""
    return v41_specs if is_v41(cfg) else v4_specs


def all_specs(cfg):
    return table(cfg).all_specs(cfg)


def global_specs(cfg):
    return table(cfg).global_specs(cfg)


def layer_specs(cfg, i: int):
    return table(cfg).layer_specs(cfg, i)
