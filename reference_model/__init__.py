"""Golden-reference DeepSeek-V4 (and V4.1: reference_model/v41) forward with a kernel seam
(see numerics.py); `build_model` picks the version by the config."""
from .config import ConfigError, ModelConfig, flash, preset, tiny
from .model import InputError, Model, SequenceState
from .factory import build_model, model_class
from .numerics import KERNELS as _V4_KERNELS, Numerics
from .v41.numerics import V41_KERNELS
from .taps import Taps
from .weights import InMemoryWeights, WeightSource, random_weights

# every replaceable kernel name: V4's seam and the steps V4.1 adds (v41/numerics.py)
KERNELS = tuple(dict.fromkeys(_V4_KERNELS + V41_KERNELS))

__all__ = ["ConfigError", "ModelConfig", "flash", "preset", "tiny", "InputError", "Model", "build_model", "model_class",
           "SequenceState", "KERNELS", "Numerics", "Taps", "InMemoryWeights", "WeightSource",
           "random_weights"]
