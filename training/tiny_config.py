"""The trained model's config: `tiny()` as is (every V4 feature active: window-only, CSA
with index_topk 16 far below the 64–192 compressed entries at training lengths, HCA,
hash-routed and scored MoE, hc_mult 4), renamed so checkpoints say what they are."""
from __future__ import annotations

from reference_model.config import ModelConfig, tiny


def tiny_needle() -> ModelConfig:
    return tiny().replace(name="tiny-needle")
