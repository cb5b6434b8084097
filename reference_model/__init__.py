"""Golden-reference DeepSeek-V4 (and V4.1: reference_model/v41) forward with a kernel seam
(see numerics.py); `build_model` picks the version by the config."""
from .config import ConfigError, ModelConfig, flash, preset, tiny
from .model import InputError, Model, SequenceState
from .factory import build_model, model_class
from .numerics import KERNELS, Numerics
from .taps import Taps
from .weights import InMemoryWeights, WeightSource, random_weights

__all__ = ["ConfigError", "ModelConfig", "flash", "preset", "tiny", "InputError", "Model", "build_model", "model_class",
           "SequenceState", "KERNELS", "Numerics", "Taps", "InMemoryWeights", "WeightSource",
           "random_weights"]
