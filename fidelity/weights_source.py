"""Which weights a command runs on: a DeepSeek-native checkpoint (streamed layer by
layer), or the embedded default — the trained tiny model shipped in models/tiny-needle
(falling back to seeded random tiny weights if that folder is absent)."""
from __future__ import annotations

from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "tiny-needle"


def load_weights(checkpoint: str | None, device: str = "cpu"):
    """Returns (WeightSource, label for the manifest)."""
    if checkpoint:
        path = Path(checkpoint)
        if not path.exists():
            raise SystemExit(f"error: checkpoint not found: {path}")
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
