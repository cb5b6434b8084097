"""Arms as the needle runners and `fidelity serve` see them: a name plus a way to make
the arm's Numerics. Arm strings (and $DSV4_FIDELITY_ARM) are parsed by kernel_toggles,
imported lazily; without it only `golden` exists."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

ENV_VAR = "DSV4_FIDELITY_ARM"


class ArmError(ValueError):
    """An arm string that cannot be parsed."""


@dataclass(frozen=True)
class Arm:
    name: str                                   # canonical spelling, e.g. "golden"
    make_numerics: Callable[..., object]        # profile -> reference_model.Numerics
    toggles: tuple[str, ...] = ()               # each toggle's spelling, with its parameters

    def numerics(self, profile: str = "reference", **numerics_kwargs):
        """The arm's Numerics (numerics_kwargs, e.g. compute_dtype, go to Numerics)."""
        return self.make_numerics(profile, **numerics_kwargs)


def _golden(profile: str = "reference", **numerics_kwargs):
    from reference_model import Numerics
    return Numerics(profile, **numerics_kwargs)


def _toggle_set():
    try:
        from kernel_toggles import ToggleSet
    except ImportError:
        return None
    return ToggleSet if hasattr(ToggleSet, "parse") else None


def parse_arm(text: str | None) -> Arm:
    """'golden' (or empty), 'engine', 'engine:sglang', 'kv_bf16,splitk_decode(splits=8)', ..."""
    text = (text or "").strip()
    ts_cls = _toggle_set()
    if ts_cls is None:
        if text in ("", "golden"):
            return Arm("golden", _golden)
        raise ArmError(f"arm {text!r} needs kernel_toggles, which is not available; "
                       "only 'golden' is valid")
    try:
        ts = ts_cls.parse(text)
    except ValueError as e:
        raise ArmError(str(e)) from None
    return Arm(str(ts), ts.numerics, tuple(str(t) for t in ts))


def as_arm(x) -> Arm:
    """An Arm from a string, an Arm, a ToggleSet-like object (has .numerics) or a callable
    profile -> Numerics."""
    if isinstance(x, Arm):
        return x
    if x is None or isinstance(x, str):
        return parse_arm(x)
    if hasattr(x, "numerics"):
        return Arm(str(x), x.numerics)
    if callable(x):
        return Arm(getattr(x, "__name__", "custom"), x)
    raise ArmError(f"cannot make an arm from {x!r}")


def arm_from_env(environ=None) -> Arm:
    env = os.environ if environ is None else environ
    try:
        return parse_arm(env.get(ENV_VAR, ""))
    except ArmError as e:
        raise ArmError(f"${ENV_VAR}: {e}") from None


def engine_arm() -> Arm | None:
    """All optimization toggles, or None when kernel_toggles is not available."""
    if _toggle_set() is None:
        return None
    return parse_arm("engine")
