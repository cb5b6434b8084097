"""Which weights a command runs on: a DeepSeek-native checkpoint (streamed layer by
layer; a DeepSeek-V4.1 one is read by reference_model/v41), or the embedded default — the
trained tiny model shipped in models/tiny-needle (falling back to seeded random tiny
weights if that folder is absent). The other embedded models are selected by name:
`--checkpoint tiny-needle-v2` or `embedded:tiny-needle-v2` resolve to
models/tiny-needle-v2 (`resolve_checkpoint`)."""
from __future__ import annotations

from pathlib import Path

from fidelity.errors import CommandError
from reference_model import random_weights, tiny
from reference_model.checkpoint import CheckpointError, StreamingWeights, load_checkpoint
from reference_model.resident import QuantisedResidentWeights
from reference_model.tokenizer import load_tokenizer
from reference_model.v41.checkpoint_read import is_v41_checkpoint

MODELS = Path(__file__).resolve().parents[2] / "models"
EMBEDDED = MODELS / "tiny-needle"

WEIGHT_MODES = ("streamed", "resident-quantised", "dense")


class WeightsError(CommandError, ValueError):
    """Weights the user named that cannot be loaded: a missing checkpoint, an unknown
    weights mode, a tokenizer larger than the model's vocabulary. Always a usage error, so
    it is a CommandError (the CLI prints it and exits 2) and a ValueError (for the
    commands and callers that catch bad input as ValueError)."""


def embedded_models() -> list[str]:
    """Names of the models shipped in models/ (folders with a config.json)."""
    return sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file()) if MODELS.is_dir() else []


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A checkpoint argument as a path: an existing path as given; otherwise `NAME` or
    `embedded:NAME` names an embedded model, models/NAME. A name that is neither comes
    back as the path it spells (the caller reports it missing); `embedded:` with an
    unknown name raises WeightsError listing the embedded models."""
    text = str(checkpoint)
    path = Path(text)
    if path.exists():
        return path
    name = text[len("embedded:"):] if text.startswith("embedded:") else text
    if name and "/" not in name and (MODELS / name / "config.json").is_file():
        return MODELS / name
    if text.startswith("embedded:"):
        raise WeightsError(f"no embedded model {name!r}; embedded models: "
                           f"{', '.join(embedded_models()) or 'none'}")
    return path


def load_weights(checkpoint: str | None, device: str = "cpu", mode: str = "streamed", devices=None,
                 layers: range | None = None):
    """Returns (WeightSource, label for the manifest). A checkpoint is `streamed` (one
    dequantised layer resident; each pass re-reads it), `resident-quantised` (the
    checkpoint's own tensors resident on `devices`, dequantised on use; with `layers`, a
    pipeline stage's, only those layers are read) or `dense` (all dequantised in memory).
    Raises WeightsError."""
    if checkpoint:
        path = resolve_checkpoint(checkpoint)
        if not path.exists():
            raise WeightsError(f"checkpoint not found: {path}")
        if mode not in WEIGHT_MODES:
            raise WeightsError(f"weights mode must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
        if path.is_file() and path.suffix != ".safetensors":
            raise WeightsError(f"checkpoint {path} is a file; give the checkpoint folder (config.json "
                               "and *.safetensors shards)")
        try:
            return _open(path, device, mode, devices, layers)
        except CheckpointError as e:                # e.g. an empty folder: no config.json
            raise WeightsError(f"checkpoint {path} is not a usable checkpoint: {_problems(e)}") from None
    if (EMBEDDED / "config.json").is_file():
        return load_checkpoint(EMBEDDED, device=device), "embedded:tiny-needle"
    return random_weights(tiny(), 0), "embedded:tiny-random(seed=0)"


def _problems(e: CheckpointError) -> str:
    """A CheckpointError's problems on one line (the caller names the checkpoint)."""
    n = len(e.problems)
    return f"{n} problem{'s' * (n != 1)}: " + "; ".join(e.problems) if n > 1 else "; ".join(e.problems)


def _open(path: Path, device: str, mode: str, devices, layers):
    """(WeightSource, label) of an existing checkpoint path in `mode`."""
    if is_v41_checkpoint(path):
        return _load_v41(path, device, mode, devices, layers)
    if mode == "resident-quantised":
        return (QuantisedResidentWeights(path, device=device, devices=devices, layers=layers),
                f"{path} (resident-quantised)")
    if mode == "dense":
        return load_checkpoint(path, device=device), f"{path} (dense)"
    return StreamingWeights(path, device=device), str(path)


def _load_v41(path: Path, device: str, mode: str, devices=None, layers: range | None = None):
    """A DeepSeek-V4.1 checkpoint (reference_model/v41), in any of the three modes."""
    from reference_model.v41.checkpoint_read import StreamingWeights as V41Streaming
    from reference_model.v41.checkpoint_read import load_checkpoint as v41_load
    from reference_model.v41.resident import V41QuantisedResidentWeights
    if mode == "resident-quantised":
        return (V41QuantisedResidentWeights(path, device=device, devices=devices, layers=layers),
                f"{path} (resident-quantised)")
    if mode == "dense":
        return v41_load(path, device=device), f"{path} (dense)"
    return V41Streaming(path, device=device), str(path)


def checkpoint_config(checkpoint: str | None):
    """The model config a command will run, read without loading weights (a pipeline
    stage needs it to know its layers before it reads them)."""
    from reference_model.v41.config import any_config_from_file
    root = resolve_checkpoint(checkpoint) if checkpoint else EMBEDDED
    for p in (root / "config.json", root / "inference" / "config.json"):
        if p.is_file():
            try:
                return any_config_from_file(p)
            except ValueError as e:
                raise WeightsError(f"{p}: {e}") from None
    if checkpoint:
        raise WeightsError(f"checkpoint not found or without config.json: {root}")
    return tiny()


def load_tokenizer_for(checkpoint: str | None):
    """The checkpoint's (or the embedded model's) tokenizer.json, or None for a model
    that has none (prompts are then random token ids)."""
    root = resolve_checkpoint(checkpoint) if checkpoint else EMBEDDED
    if (root / "tokenizer.json").is_file():
        return load_tokenizer(root / "tokenizer.json")
    return None
