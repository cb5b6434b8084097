"""Which weights a command runs on: a DeepSeek-native checkpoint (streamed layer by
layer) or the embedded default."""
from __future__ import annotations

from pathlib import Path


def load_weights(checkpoint: str | None, device: str = "cpu"):
    """Returns (WeightSource, label for the manifest)."""
    if checkpoint:
        path = Path(checkpoint)
        if not path.exists():
            raise SystemExit(f"error: checkpoint not found: {path}")
        from reference_model.checkpoint import StreamingWeights
        return StreamingWeights(path, device=device), str(path)
    from reference_model import random_weights, tiny
    return random_weights(tiny(), 0), "embedded:tiny-random(seed=0)"
