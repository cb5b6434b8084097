"""Engine numerics as switchable kernel replacements ("toggles") on the reference model's
kernel seam, sets of them ("arms"), and the engine settings each one corresponds to.

    from kernel_toggles import ToggleSet
    arm = ToggleSet.parse("index_keys_fp8,splitk_decode(splits=8)")   # or ToggleSet.from_env()
    model = Model(weights, arm.numerics())
"""
from . import builtin  # noqa: F401  (registers the built-in toggles)
from .arms import (ENV_VAR, ToggleSet, ToggleSpec, engine, factorial, golden, leave_one_out,
                   one_at_a_time, optimizations, version_of)
from .registry import (CATEGORIES, Param, Provenance, Toggle, ToggleError, all_toggles, get,
                       names, toggle, unregister)
from .table import render_markdown, render_text

__all__ = ["ENV_VAR", "ToggleSet", "ToggleSpec", "engine", "factorial", "golden",
           "leave_one_out", "one_at_a_time", "optimizations", "version_of", "CATEGORIES", "Param",
           "Provenance", "Toggle", "ToggleError", "all_toggles", "get", "names", "toggle",
           "unregister", "render_markdown", "render_text"]
