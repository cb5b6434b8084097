"""Which weights a command runs on: a DeepSeek-native checkpoint (streamed layer by
layer), or the embedded default — the trained tiny model shipped in models/tiny-needle
(falling back to seeded random tiny weights if that folder is absent)."""
from __future__ import annotations

from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-needle"


WEIGHT_MODES = ("streamed", "resident-quantised", "dense")


def load_weights(checkpoint: str | None, device: str = "cpu", mode: str = "streamed", devices=None):
    """Returns (WeightSource, label for the manifest). A checkpoint is `streamed` (one
    dequantised layer resident; each pass re-reads it), `resident-quantised` (the
    checkpoint's own tensors resident on `devices`, dequantised on use) or `dense` (all
    dequantised in memory)."""
    if checkpoint:
        path = Path(checkpoint)
        if not path.exists():
            raise SystemExit(f"error: checkpoint not found: {path}")
        if mode not in WEIGHT_MODES:
            raise SystemExit(f"error: weights mode must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
        if mode == "resident-quantised":
            from reference_model.resident import QuantisedResidentWeights
            return QuantisedResidentWeights(path, device=device, devices=devices), f"{path} (resident-quantised)"
        if mode == "dense":
            from reference_model.checkpoint import load_checkpoint
            return load_checkpoint(path, device=device), f"{path} (dense)"
        from reference_model.checkpoint import StreamingWeights
        return StreamingWeights(path, device=device), str(path)
    if (EMBEDDED / "config.json").is_file():
        from reference_model.checkpoint import load_checkpoint
        return load_checkpoint(EMBEDDED, device=device), "embedded:tiny-needle"
    from reference_model import random_weights, tiny
    return random_weights(tiny(), 0), "embedded:tiny-random(seed=0)"


def load_tokenizer_for(checkpoint: str | None):
    """The checkpoint's (or the embedded model's) tokenizer.json, or None for a model
    that has none (prompts are then random token ids)."""
    root = Path(checkpoint) if checkpoint else EMBEDDED
    if (root / "tokenizer.json").is_file():
        from reference_model.tokenizer import load_tokenizer
        return load_tokenizer(root / "tokenizer.json")
    return None
