"""What the in-process needle runner and `fidelity serve` run: weights plus tokenizer.

The embedded default is whatever `fidelity.weights.source.load_weights(None)` gives (the
same model `fidelity ab` uses: the trained tiny model in models/tiny-needle with its
tokenizer, or seeded random tiny weights when that folder is absent, where needle recall
is ~0 by construction). A checkpoint directory is
loaded into memory, dense or resident-quantised (generation revisits every layer per
token, so streaming from disk would reread the checkpoint at each step); its
tokenizer.json is used if present."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reference_model.tokenizer import TokenizerError, load_tokenizer

from .source import EMBEDDED, WeightsError, load_weights, resolve_checkpoint


@dataclass
class Target:
    name: str
    weights: object                     # reference_model WeightSource
    tokenizer: object                   # reference_model.tokenizer.ChatTokenizer
    description: str

    @property
    def cfg(self):
        return self.weights.cfg


def load_target(checkpoint: str | Path | None = None, tokenizer: str | Path | None = None,
                weights_mode: str = "dense", devices=None) -> Target:
    """Raises WeightsError for a missing checkpoint, a bad weights mode, a tokenizer file
    that is missing or not a DeepSeek-V4 tokenizer.json, or a tokenizer with more tokens
    than the model's vocabulary."""
    if checkpoint is None:
        weights, label = load_weights(None)
        name = label.split(":", 1)[-1].split("(")[0]
        desc = f"embedded default {label}"
        if name == "tiny-random":
            desc += " (untrained: needle recall near 0 is expected)"
        root = EMBEDDED
    else:
        root = resolve_checkpoint(checkpoint)       # a path, or an embedded model's name
        if not root.exists():
            raise WeightsError(f"checkpoint not found: {root}")
        weights, label = load_weights(str(root), mode=weights_mode, devices=devices)
        name, desc = root.name, f"checkpoint {label}"
    if tokenizer is None and (root / "tokenizer.json").is_file():
        tokenizer = root / "tokenizer.json"
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as e:                    # missing, unreadable, not DeepSeek-V4's
        raise WeightsError(str(e)) from None
    if tok.vocab_size > weights.cfg.vocab_size:
        raise WeightsError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's "
                           f"vocab_size is {weights.cfg.vocab_size}; pass --tokenizer")
    return Target(name, weights, tok, desc)
