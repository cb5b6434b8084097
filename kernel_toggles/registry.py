"""The toggle registry: one entry per engine optimization or known bug.

A toggle names the golden kernel(s) it replaces (reference_model.numerics.KERNELS), says
what engine behaviour it reproduces and where that behaviour comes from, and has typed
parameters with defaults. Built-in toggles (kernel_toggles.builtin) and user toggles are
registered through the same `toggle` decorator, so they are interchangeable in arms.

Registration order is the canonical order: arms print and apply their toggles in it, so
an arm means the same thing however its toggles were listed."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from reference_model import KERNELS       # V4's seam and V4.1's steps
from reference_model.v41.numerics import V4_KERNELS_SHARED, V41_KERNELS

# serving: engine behaviour by design that depends on serving state (batch, cache hits);
# like known-bug it stays out of the `engine` arm, which is the numerics at batch 1
CATEGORIES = ("optimization", "known-bug", "request", "serving")
# model versions ('v4' DeepSeek-V4, 'v41' DeepSeek-V4.1): each version's `engine` arm takes
# the optimizations documented for it
VERSIONS = ("v4", "v41")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_PARAM_TYPES = (int, float, bool, str)


class ToggleError(ValueError):
    """Unknown toggle, bad parameter, malformed arm string or conflicting toggles."""


@dataclass(frozen=True)
class Param:
    """A typed toggle parameter. `choices` restricts str values; `min` bounds numbers."""
    name: str
    type: type
    default: Any
    help: str = ""
    choices: tuple = ()
    min: float | None = None

    def __post_init__(self):
        if self.type not in _PARAM_TYPES:
            raise ToggleError(f"parameter {self.name!r}: type must be one of int, float, bool, str")
        self.check(self.default)

    def describe(self) -> str:
        s = f"{self.name}: {self.type.__name__} = {self.format(self.default)}"
        if self.choices:
            s += f" ({'|'.join(map(str, self.choices))})"
        elif self.min is not None:
            s += f" (>= {self.format(self.min)})"
        return s

    def format(self, v) -> str:
        if self.type is bool:
            return "true" if v else "false"
        return str(v)

    def convert(self, raw):
        """Typed value from a string (arm syntax) or a Python value; raises ToggleError."""
        t = self.type
        if isinstance(raw, str):
            s = raw.strip()
            if t is bool:
                low = s.lower()
                if low in ("1", "true", "yes", "on"):
                    v = True
                elif low in ("0", "false", "no", "off"):
                    v = False
                else:
                    raise ToggleError(f"parameter {self.name}: {raw!r} is not a boolean (true/false)")
            elif t is str:
                v = s
            else:
                try:
                    v = t(s)
                except ValueError:
                    raise ToggleError(f"parameter {self.name}: {raw!r} is not {'an' if t is int else 'a'} "
                                      f"{t.__name__}") from None
        else:
            if t is float and isinstance(raw, int) and not isinstance(raw, bool):
                v = float(raw)
            elif isinstance(raw, t) and not (t is int and isinstance(raw, bool)):
                v = raw
            else:
                raise ToggleError(f"parameter {self.name}: {raw!r} is not of type {t.__name__}")
        self.check(v)
        return v

    def check(self, v):
        if self.choices and v not in self.choices:
            raise ToggleError(f"parameter {self.name}: {v!r} is not one of "
                              f"{', '.join(map(str, self.choices))}")
        if self.min is not None and v < self.min:
            raise ToggleError(f"parameter {self.name}: {v!r} is below the minimum {self.min}")


@dataclass(frozen=True)
class Provenance:
    """Where the behaviour comes from: engines, the settings that select it, PRs/issues.
    `unconfirmed` notes what the research could not pin down."""
    engines: tuple[str, ...]
    settings: tuple[str, ...] = ()
    refs: tuple[str, ...] = ()
    unconfirmed: str = ""

    def short(self) -> str:
        parts = ["/".join(self.engines)]
        if self.settings:
            parts.append(", ".join(self.settings))
        if self.refs:
            parts.append(", ".join(self.refs))
        s = "; ".join(parts)
        return s + (" (UNCONFIRMED: " + self.unconfirmed + ")" if self.unconfirmed else "")


@dataclass(frozen=True)
class Toggle:
    """A registered toggle. `factory(**params)` returns {kernel: fn(golden, *args, **kw)}."""
    name: str
    kernels: tuple[str, ...]
    category: str
    description: str
    provenance: Provenance
    params: tuple[Param, ...]
    factory: Callable[..., dict]
    group: str | None = None            # toggles sharing a group are mutually exclusive
    phase: str = "all"                  # 'all' or 'decode' (acts on decode steps only)
    wraps: tuple[str, ...] = ()         # kernels whose replacement calls golden.<kernel>
    subsumes: tuple[str, ...] = ()      # toggles whose behaviour this one already includes
    versions: tuple[str, ...] = VERSIONS  # model versions it is documented for (engine arms)
    engine_arm: bool = True             # False: one engine's own arithmetic, not in `engine`
    builtin: bool = False
    order: int = field(default=0, compare=False)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ToggleError(f"toggle {self.name} has no parameter {name!r}; "
                          f"valid: {self.param_summary() or 'none'}")

    def param_summary(self) -> str:
        return ", ".join(p.describe() for p in self.params)

    def resolve(self, values: dict) -> tuple[tuple[str, Any], ...]:
        """Full, typed, ordered parameter tuple from user values (defaults filled in)."""
        out = []
        known = {p.name for p in self.params}
        extra = sorted(set(values) - known)
        if extra:
            raise ToggleError(f"toggle {self.name} has no parameter(s) {', '.join(extra)}; "
                              f"valid: {self.param_summary() or 'none'}")
        for p in self.params:
            out.append((p.name, p.convert(values[p.name]) if p.name in values else p.default))
        return tuple(out)

    def build(self, params: tuple[tuple[str, Any], ...]) -> dict:
        fns = self.factory(**dict(params))
        if set(fns) != set(self.kernels):
            raise ToggleError(f"toggle {self.name}: factory returned kernels {sorted(fns)}, "
                              f"declared {sorted(self.kernels)}")
        return fns


_REGISTRY: dict[str, Toggle] = {}
_counter = [0]


def versions_of(kernels) -> tuple[str, ...]:
    """The model versions whose forward calls at least one of `kernels`: a V4.1 step acts on
    V4.1 only, a V4 kernel V4.1 does not call on V4 only, a shared one on both."""
    ks = set(kernels)
    out = ("v4",) if ks - set(V41_KERNELS) else ()
    return out + (("v41",) if ks & set(V41_KERNELS + V4_KERNELS_SHARED) else ())


def _validate(name, kernels, category, params, phase, wraps=()):
    if not _NAME_RE.match(name):
        raise ToggleError(f"toggle name {name!r} must match {_NAME_RE.pattern}")
    bad = [k for k in kernels if k not in KERNELS]
    if bad or not kernels:
        raise ToggleError(f"toggle {name}: unknown kernel(s) {bad or '(none given)'}; "
                          f"valid: {', '.join(KERNELS)}")
    if category not in CATEGORIES:
        raise ToggleError(f"toggle {name}: category must be one of {', '.join(CATEGORIES)}")
    if set(wraps) - set(kernels):
        raise ToggleError(f"toggle {name}: wraps={sorted(set(wraps) - set(kernels))} are not among "
                          f"the kernels it replaces ({', '.join(kernels)})")
    if phase not in ("all", "decode"):
        raise ToggleError(f"toggle {name}: phase must be 'all' or 'decode'")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ToggleError(f"toggle {name}: duplicate parameter names {names}")


def _as_params(params) -> tuple[Param, ...]:
    """Accept Param objects or a {name: default} dict (type taken from the default)."""
    if isinstance(params, dict):
        return tuple(Param(k, type(v), v) for k, v in params.items())
    return tuple(params or ())


def toggle(name: str, *, kernel: str | None = None, kernels: tuple[str, ...] | None = None,
           description: str = "", category: str | None = None,
           provenance: Provenance | None = None, params=(), group: str | None = None,
           phase: str = "all", wraps: tuple[str, ...] | bool = (), subsumes: tuple[str, ...] = (),
           versions: tuple[str, ...] | None = None, engine_arm: bool = True, replace: bool = False,
           _builtin: bool = False):
    """Register a kernel replacement as a toggle usable in arms (ToggleSet) by `name`.

    Single kernel: decorate `fn(golden, *kernel_args, <param>=..., **kw)`; the toggle's
    parameters arrive as keyword arguments. Several kernels: pass `kernels=(...)` and
    decorate a factory `f(**params) -> {kernel: fn(golden, *args, **kw)}`.
    `golden` is the Numerics the toggle is applied on (golden plus any toggles earlier in
    the canonical order), so a replacement can fall back to it or call its other kernels.

    `category` ('optimization' or 'known-bug') must be given for user toggles: only
    optimizations join the `engine` arm. `wraps` lists the kernels whose replacement calls
    `golden.<kernel>` (True = all of them): only then may an earlier toggle in the same arm
    replace that kernel too (they compose); otherwise the arm is refused rather than one
    toggle silently shadowing the other. `subsumes` names toggles whose behaviour this one
    already includes (the `engine` arm then leaves them out). `versions` ('v4', 'v41'): the
    model versions the behaviour is documented for, so the version's `engine` arm takes it
    (default: the versions whose forward calls one of its kernels). `engine_arm=False`: the
    arithmetic of one engine alone (llama.cpp's CPU kernels), never part of the generic
    `engine` arm; engine_profiles.json still places it in its own engine's."""
    if (kernel is None) == (kernels is None):
        raise ToggleError("give exactly one of kernel= or kernels=")
    ks = (kernel,) if kernel else tuple(kernels)
    if category is None:
        if not _builtin:
            raise ToggleError(f"toggle {name}: give category= explicitly ('optimization' joins "
                              f"every `engine` arm, 'known-bug' does not)")
        category = "optimization"
    wr = ks if wraps is True else tuple(wraps or ())
    ps = _as_params(params)
    _validate(name, ks, category, ps, phase, wr)
    vs = versions_of(ks) if versions is None else tuple(versions)
    if not vs or set(vs) - set(VERSIONS):
        raise ToggleError(f"toggle {name}: versions must be among {', '.join(VERSIONS)}, got {vs}")

    def deco(fn):
        if not _builtin:
            _ensure_builtins()                     # so a clash with a built-in is seen
        prev = _REGISTRY.get(name)
        if prev is not None and prev.builtin:
            raise ToggleError(f"toggle {name!r} clashes with the built-in toggle of that name; "
                              f"choose another name")
        if prev is not None and not replace:
            raise ToggleError(f"toggle {name!r} is already registered (pass replace=True)")
        if kernel is not None:
            def factory(**pv):
                def impl(golden, *a, **kw):
                    return fn(golden, *a, **kw, **pv)
                impl.__name__ = f"{name}.{kernel}"
                return {kernel: impl}
        else:
            factory = fn
        doc = description or inspect.cleandoc(fn.__doc__ or "").replace("\n", " ")
        if not doc:
            raise ToggleError(f"toggle {name}: give a description (or a docstring)")
        prov = provenance or Provenance(engines=("custom",))
        _counter[0] += 1
        _REGISTRY[name] = Toggle(name=name, kernels=ks, category=category, description=doc,
                                 provenance=prov, params=ps, factory=factory, group=group,
                                 phase=phase, wraps=wr, subsumes=tuple(subsumes), versions=vs,
                                 engine_arm=engine_arm, builtin=_builtin,
                                 order=prev.order if prev else _counter[0])
        return fn
    return deco


def subsumed_by(names) -> set[str]:
    """Toggles that one of `names` already includes (see `toggle(subsumes=...)`)."""
    return {n for name in names for n in get(name).subsumes}


def unregister(name: str) -> None:
    """Remove a user toggle (built-ins are permanent)."""
    t = get(name)
    if t.builtin:
        raise ToggleError(f"toggle {name} is built in and cannot be unregistered")
    del _REGISTRY[name]


def get(name: str) -> Toggle:
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ToggleError(f"unknown toggle {name!r}; valid: {', '.join(names())}") from None


def names() -> list[str]:
    """All toggle names in canonical order."""
    return [t.name for t in all_toggles()]


def all_toggles(category: str | None = None) -> list[Toggle]:
    _ensure_builtins()
    ts = sorted(_REGISTRY.values(), key=lambda t: t.order)
    return [t for t in ts if category is None or t.category == category]


def _ensure_builtins():
    from . import builtin  # noqa: F401  (registers on first import)
