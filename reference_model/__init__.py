"""Golden-reference DeepSeek-V4 forward with a kernel seam (see numerics.py)."""
from .config import ConfigError, ModelConfig, flash, preset, tiny
from .model import InputError, Model, SequenceState
from .numerics import KERNELS, Numerics
from .taps import Taps
from .weights import InMemoryWeights, WeightSource, random_weights

__all__ = ["ConfigError", "ModelConfig", "flash", "preset", "tiny", "InputError", "Model",
           "SequenceState", "KERNELS", "Numerics", "Taps", "InMemoryWeights", "WeightSource",
           "random_weights"]
