"""Arms: immutable sets of toggles, their one-line spelling, and the standard designs.

Syntax (also the value of DSV4_FIDELITY_ARM): comma-separated toggles, each optionally
with parameters, e.g. `index_keys_fp8,splitk_decode(splits=8)`; positional values are
allowed in declaration order (`splitk_decode(8)`). `golden` (or empty) is the empty arm,
`engine` all optimizations, `engine:sglang` / `engine:vllm` the engine's default numerics
from engine_profiles.json, and `engine-x-y` (ASCII minus) the engine arm without x and y.
The `engine` spellings depend on the model version (`model`: 'v4' or 'v41', version_of):
only toggles documented for that version are in them.
Printing gives one canonical spelling: toggles in registry
order, parameters in declaration order, parameters at their default left out."""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from reference_model.numerics import Numerics

from . import profiles
from . import registry as R
from .registry import ToggleError

ENV_VAR = "DSV4_FIDELITY_ARM"
GOLDEN = "golden"
# `engine`, `engine:sglang`, `engine-kv_bf16-wo_a_fp8` (the engine arm minus those toggles)
_ENGINE_RE = re.compile(r"^engine(?::([a-z0-9_]+))?((?:-[a-z][a-z0-9_]*)*)$")
_ITEM_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


@dataclass(frozen=True)
class ToggleSpec:
    """One toggle with fully resolved, typed parameters."""
    name: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def make(cls, name: str, **values) -> "ToggleSpec":
        t = R.get(name)
        return cls(name, t.resolve(values))

    @property
    def toggle(self) -> R.Toggle:
        return R.get(self.name)

    def __str__(self) -> str:
        t = self.toggle
        shown = [f"{k}={t.param(k).format(v)}" for k, v in self.params if v != t.param(k).default]
        return self.name + (f"({','.join(shown)})" if shown else "")

    def kwargs(self) -> dict:
        return dict(self.params)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside parentheses; unbalanced parentheses are an error."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ToggleError(f"unbalanced ')' in arm {text!r}")
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ToggleError(f"unbalanced '(' in arm {text!r}")
    out.append("".join(cur))
    return out


def parse_spec(item: str) -> ToggleSpec:
    m = _ITEM_RE.match(item)
    if not m:
        raise ToggleError(f"cannot parse toggle {item.strip()!r}: expected name or "
                          f"name(key=value,...); valid names: {', '.join(R.names())}")
    name, args = m.group(1), m.group(2)
    t = R.get(name)
    values: dict[str, Any] = {}
    if args is not None and args.strip():
        for i, a in enumerate(_split_top(args)):
            a = a.strip()
            if not a:
                raise ToggleError(f"empty parameter in {item.strip()!r}")
            if "=" in a:
                k, v = (s.strip() for s in a.split("=", 1))
                t.param(k)                                  # raises with the valid names
            else:
                if i >= len(t.params):
                    raise ToggleError(f"toggle {name} takes {len(t.params)} parameter(s), got "
                                      f"more in {item.strip()!r}; valid: "
                                      f"{t.param_summary() or 'none'}")
                k, v = t.params[i].name, a
            if k in values:
                raise ToggleError(f"parameter {k} given twice in {item.strip()!r}")
            values[k] = v
    return ToggleSpec(name, t.resolve(values))


def _coerce(item) -> ToggleSpec:
    if isinstance(item, ToggleSpec):
        return ToggleSpec(item.name, R.get(item.name).resolve(dict(item.params)))
    if isinstance(item, str):
        return parse_spec(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return ToggleSpec.make(item[0], **dict(item[1]))
    raise ToggleError(f"cannot make a toggle from {item!r}")


class ToggleSet:
    """An arm: an immutable, hashable set of toggles in canonical order."""
    __slots__ = ("_specs",)

    def __init__(self, items: Iterable | str = ()):
        if isinstance(items, str):                  # ToggleSet("a,b(k=v)") == parse
            items = ToggleSet.parse(items)._specs
        by_name: dict[str, ToggleSpec] = {}
        for it in items:
            s = _coerce(it)
            if s.name in by_name and by_name[s.name] != s:
                raise ToggleError(f"toggle {s.name} given twice with different parameters: "
                                  f"{by_name[s.name]} and {s}")
            by_name[s.name] = s
        specs = tuple(sorted(by_name.values(), key=lambda s: s.toggle.order))
        groups: dict[str, str] = {}
        for s in specs:
            g = s.toggle.group
            if g and g in groups:
                raise ToggleError(f"toggles {groups[g]} and {s.name} both set {g} "
                                  f"({', '.join(s.toggle.kernels)}); pick one")
            if g:
                groups[g] = s.name
        _check_composition(specs)
        object.__setattr__(self, "_specs", specs)

    def __setattr__(self, *_):
        raise AttributeError("ToggleSet is immutable")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str | None, model: str = "v4") -> "ToggleSet":
        """The arm `text` spells; `engine` spellings as for a `model` ('v4', 'v41') model."""
        text = (text or "").strip()
        if text in ("", GOLDEN):
            return cls()
        items = _split_top(text)
        if any(not i.strip() for i in items):
            raise ToggleError(f"empty toggle name in arm {text!r}; valid: {', '.join(R.names())}")
        specs: list[ToggleSpec] = []
        for i in items:                      # `engine[:NAME][-t1-t2...]` expand in place
            i = i.strip()
            m = _ENGINE_RE.match(i)
            if m:
                base = engine(m.group(1), model)
                drops = [d for d in (m.group(2) or "").split("-") if d]
                specs += list(base.without(*drops) if drops else base)
            else:
                specs.append(parse_spec(i))
        return cls(specs)

    @classmethod
    def from_env(cls, environ=None, var: str = ENV_VAR) -> "ToggleSet":
        """The arm named by $DSV4_FIDELITY_ARM (unset or empty = golden)."""
        env = os.environ if environ is None else environ
        try:
            return cls.parse(env.get(var, ""))
        except ToggleError as e:
            raise ToggleError(f"${var}: {e}") from None

    @classmethod
    def of(cls, *names: str, **with_params: dict) -> "ToggleSet":
        """ToggleSet.of('kv_bf16', splitk_decode={'splits': 8})."""
        return cls([*names, *((k, v) for k, v in with_params.items())])

    # ---- set behaviour -------------------------------------------------------------------
    @property
    def specs(self) -> tuple[ToggleSpec, ...]:
        return self._specs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    def __iter__(self):
        return iter(self._specs)

    def __len__(self):
        return len(self._specs)

    def __contains__(self, name) -> bool:
        n = name.name if isinstance(name, ToggleSpec) else name
        return n in self.names

    def __getitem__(self, name: str) -> ToggleSpec:
        for s in self._specs:
            if s.name == name:
                return s
        raise KeyError(f"{name} is not in arm {self}")

    def __eq__(self, other):
        return isinstance(other, ToggleSet) and self._specs == other._specs

    def __hash__(self):
        return hash(self._specs)

    def __str__(self):
        return ",".join(map(str, self._specs)) or GOLDEN

    def __repr__(self):
        return f"ToggleSet({str(self)!r})"

    def __or__(self, other: "ToggleSet") -> "ToggleSet":
        return ToggleSet([*self._specs, *other._specs])

    def with_(self, *items) -> "ToggleSet":
        return ToggleSet([*self._specs, *items])

    def without(self, *names: str) -> "ToggleSet":
        for n in names:
            R.get(n)
            if n not in self:
                raise ToggleError(f"{n} is not in arm {self}")
        return ToggleSet(s for s in self._specs if s.name not in names)

    @property
    def is_golden(self) -> bool:
        return not self._specs

    @property
    def kernels(self) -> tuple[str, ...]:
        out: list[str] = []
        for s in self._specs:
            out += [k for k in s.toggle.kernels if k not in out]
        return tuple(out)

    # ---- numerics ------------------------------------------------------------------------
    def numerics(self, profile: str = "reference", base=None, **numerics_kwargs):
        """The arm's Numerics: `base` (default Numerics(profile)) with each toggle's kernels
        applied in canonical order; each toggle sees the previous ones as its golden."""
        nx = base if base is not None else Numerics(profile, **numerics_kwargs)
        top: list = []                     # filled with the finished arm (see with_kernels)
        for s in self._specs:
            nx = nx.with_kernels(str(s), _top=top, **s.toggle.build(s.params))
        top.append(nx)
        return nx


def is_engine_spelling(text: str) -> bool:
    """True for `engine`, `engine:NAME` and `engine[:NAME]-x-y`: names to which `-t` can be
    appended and still parse (leave-one-out labels)."""
    return bool(_ENGINE_RE.match(text.strip()))


def _check_composition(specs) -> None:
    """Two toggles may replace the same kernel only if the later one (canonical order)
    wraps it, i.e. calls golden.<kernel> and so builds on the earlier one. Anything else
    would let one silently shadow the other, so the arm is refused, naming both."""
    owner: dict[str, str] = {}
    for s in specs:
        t = s.toggle
        for other in t.subsumes:
            if other in (x.name for x in specs):
                raise ToggleError(f"toggles {other} and {t.name} cannot be combined: {t.name} "
                                  f"already includes {other}'s behaviour; drop {other}")
        for k in t.kernels:
            if k in owner and k not in t.wraps:
                raise ToggleError(f"toggles {owner[k]} and {t.name} both replace kernel {k} and "
                                  f"{t.name} does not wrap it, so it would silently shadow "
                                  f"{owner[k]}; use one of them (or register {t.name} with "
                                  f"wraps=({k!r},) if it calls golden.{k})")
            owner[k] = t.name


# ---- standard designs ---------------------------------------------------------------------
def golden() -> ToggleSet:
    return ToggleSet()


def reference_closest(engine: str, version: str | None = None) -> ToggleSet:
    """The arm closest to the reference an engine can be configured to run
    (kernel_toggles.profiles.closest_items)."""
    return ToggleSet(profiles.closest_items(engine, version).items())


def optimizations() -> list[str]:
    return [t.name for t in R.all_toggles("optimization")]


def version_of(cfg) -> str:
    """'v41' for a DeepSeek-V4.1 config, else 'v4' (the `model` of engine arms)."""
    from reference_model.v41 import is_v41
    return "v41" if is_v41(cfg) else "v4"


def engine(name: str | None = None, model: str = "v4") -> ToggleSet:
    """The optimizations documented for a `model` ('v4', 'v41') model (but not one engine's
    own arithmetic, `engine_arm=False`), in canonical order:
    the first of each exclusive group, and of toggles replacing the same kernel the first
    unless the later one wraps it. With `name`, the toggles engine_profiles.json marks as
    that engine's default behaviour (those documented for `model`)."""
    if model not in R.VERSIONS:
        raise ToggleError(f"unknown model version {model!r}; valid: {', '.join(R.VERSIONS)}")
    if name is not None:
        return ToggleSet((n, p) for n, p in profiles.default_items(name).items()
                         if model in R.get(n).versions)
    taken: set[str] = set()
    owned: set[str] = set()
    out = []
    opts = [t for t in R.all_toggles("optimization") if model in t.versions and t.engine_arm]
    subsumed = R.subsumed_by(t.name for t in opts)
    for t in opts:
        if (t.group and t.group in taken) or t.name in subsumed or (set(t.kernels) - set(t.wraps)) & owned:
            continue
        if t.group:
            taken.add(t.group)
        owned |= set(t.kernels)
        out.append(t.name)
    return ToggleSet(out)


def _as_specs(toggles) -> list[ToggleSpec]:
    if toggles is None:
        return list(engine())
    if isinstance(toggles, ToggleSet):
        return list(toggles)
    if isinstance(toggles, str):
        return list(ToggleSet.parse(toggles))
    return [_coerce(t) for t in toggles]


def one_at_a_time(toggles=None) -> list[ToggleSet]:
    """Each toggle alone (default: engine())."""
    return [ToggleSet([s]) for s in _as_specs(toggles)]


def leave_one_out(base=None) -> list[ToggleSet]:
    """`base` (default engine()) minus each of its toggles in turn."""
    specs = _as_specs(base)
    return [ToggleSet(s for s in specs if s.name != drop.name) for drop in specs]


def factorial(toggles, max_toggles: int = 10) -> list[ToggleSet]:
    """All 2^n subsets of `toggles`, golden first, then by size, then canonical order.
    Exclusive toggles cannot be crossed and are an error."""
    specs = sorted(_as_specs(toggles), key=lambda s: s.toggle.order)
    ToggleSet(specs)                                   # rejects conflicts and duplicates
    if len(specs) > max_toggles:
        raise ToggleError(f"full factorial over {len(specs)} toggles is {2 ** len(specs)} arms; "
                          f"raise max_toggles (now {max_toggles}) if you mean it")
    arms = []
    for k in range(len(specs) + 1):
        for combo in itertools.combinations(specs, k):
            arms.append(ToggleSet(combo))
    return arms
