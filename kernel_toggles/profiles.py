"""Engine profiles: which SGLang / vLLM settings turn each toggle on or off
(engine_profiles.json, from docs/research/engine-divergences.md §2–§3).

Used to build an engine's default arm and, for an engine launcher, to translate an arm
into env vars and flags — with the toggles that no known setting can realise listed
instead of silently dropped."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import registry as R
from .registry import ToggleError

PATH = Path(__file__).with_name("engine_profiles.json")
ENGINES = ("sglang", "vllm")


@functools.lru_cache(maxsize=4)
def load(path: str | None = None) -> dict:
    """The profile file, validated against the registry."""
    p = Path(path) if path else PATH
    data = json.loads(p.read_text())
    errors = validate(data)
    if errors:
        raise ToggleError(f"{p}: " + "; ".join(errors))
    return data


def validate(data: dict) -> list[str]:
    errs = []
    toggles = data.get("toggles", {})
    for name in toggles:
        if name not in R.names():
            errs.append(f"unknown toggle {name!r}")
    for t in R.all_toggles():
        if not t.builtin:
            continue
        if t.name not in toggles:
            errs.append(f"toggle {t.name} has no profile entry")
            continue
        for eng in ENGINES:
            e = toggles[t.name].get(eng)
            if e is None:
                errs.append(f"{t.name}: no {eng} entry")
                continue
            errs += mapping_errors(f"{t.name}.{eng}", e, eng, data, REQUIRED + ("params",))
            try:
                t.resolve(e.get("params", {}))
            except ToggleError as ex:
                errs.append(f"{t.name}.{eng}: {ex}")
    return errs


# keys every engine mapping (a toggle's or a serving setting's) carries
REQUIRED = ("default", "on", "off", "unconfirmed", "note")


def mapping_errors(where: str, e: dict, eng: str, data: dict, required=REQUIRED) -> list[str]:
    """Shape errors of one engine mapping (a toggle's or a serving setting's): the
    `required` keys are there, the versions it overrides exist and carry known keys, and
    `on`/`off` hold only env and flags."""
    errs = [f"{where}: missing {key!r}" for key in required if key not in e]
    known = data.get("engines", {}).get(eng, {}).get("versions", [])
    for v, over in e.get("by_version", {}).items():
        if v not in known:
            errs.append(f"{where}.by_version: {v!r} is not one of {eng}'s versions {known}")
        if set(over) - {"default", "on", "off", "unconfirmed", "note"}:
            errs.append(f"{where}.by_version.{v}: unknown keys")
    for side in ("on", "off"):
        x = e.get(side)
        if x is not None and set(x) - {"env", "flags"}:
            errs.append(f"{where}.{side}: only 'env' and 'flags' allowed")
    return errs


def entry(toggle: str, engine: str, version: str | None = None) -> dict:
    """A toggle's mapping on an engine; with a version, that version's overrides applied."""
    _check_engine(engine)
    R.get(toggle)
    try:
        e = load()["toggles"][toggle][engine]
    except KeyError:
        raise ToggleError(f"no {engine} profile for toggle {toggle}") from None
    if version is None:
        return e
    return {**e, **e.get("by_version", {}).get(profile_version(engine, version), {})}


def versions(engine: str) -> list[str]:
    _check_engine(engine)
    return list(load()["engines"][engine].get("versions", []))


def profile_version(engine: str, version: str) -> str:
    """The profiled version an engine version falls under ('0.33.0' -> '0.33'); a version
    with no mappings is an error, so no toggle is translated by another version's names."""
    for v in versions(engine):
        if version == v or version.startswith(v + "."):
            return v
    raise ToggleError(f"{engine} {version}: engine_profiles.json has mappings for "
                      f"{', '.join(versions(engine)) or 'no version'} only (env and flag names move "
                      "between versions; add a by_version entry after checking the new names)")


def _check_engine(engine: str):
    if engine not in ENGINES:
        raise ToggleError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")


def default_items(engine: str) -> dict:
    """{toggle: params} of the arm reproducing the engine's default numerics (entries with
    default: true), subsumed toggles left out (kernel_toggles.arms.engine makes the arm)."""
    _check_engine(engine)
    items = {}
    for name, per in load()["toggles"].items():
        e = per[engine]
        if e["default"] is True:
            items[name] = e["params"]
    subsumed = R.subsumed_by(items)
    return {n: p for n, p in items.items() if n not in subsumed}


@dataclass
class LaunchSettings:
    env: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    unrealisable: list = field(default_factory=list)     # (toggle, reason)
    unconfirmed: list = field(default_factory=list)      # toggles whose mapping is unconfirmed
    applied: list = field(default_factory=list)          # toggles whose settings are in env/flags
    unknown: list = field(default_factory=list)          # engine default unknown, no setting


def launch_settings(arm, engine: str, version: str | None = None) -> LaunchSettings:
    """Env vars and flags that move `engine` (at `version`) from its defaults to `arm`, as
    far as known. Only built-in toggles with a profile entry are considered."""
    _check_engine(engine)
    out = LaunchSettings()
    for name in load()["toggles"]:
        e = entry(name, engine, version)
        want = name in arm or any(name in R.get(t).subsumes for t in arm.names)
        default = e["default"]
        if default is want:
            need = None
        else:
            need = e["on"] if want else e["off"]
            if need is None and default is None:
                out.unknown.append(name)
                continue
            if need is None:
                out.unrealisable.append((name, f"no known {engine} setting turns it "
                                               f"{'on' if want else 'off'}"))
                continue
        asked = arm[name].kwargs() if name in arm else {}
        filled = _placeholders(need, asked)            # parameters the flags carry themselves
        fixed = {k: v for k, v in dict(R.get(name).resolve(e["params"])).items() if k not in filled}
        if name in arm and fixed != {k: v for k, v in asked.items() if k not in filled}:
            out.unrealisable.append((name, f"{engine} behaves as "
                                           f"{name}{_fmt(e['params'])}, arm asks {arm[name]}"))
        if need:
            out.env.update(need.get("env", {}))
            out.flags += [_fill(f, asked) for f in need.get("flags", [])]
            out.applied.append(name)
        if e["unconfirmed"] and (want or default is not False):
            out.unconfirmed.append(name)
    return out


def _placeholders(need: dict | None, params: dict) -> set:
    """The parameters whose `{name}` placeholder a setting's flags hold."""
    flags = " ".join((need or {}).get("flags", []))
    return {k for k in params if "{" + k + "}" in flags}


def _fill(flag: str, params: dict) -> str:
    """A flag with each `{name}` placeholder replaced by the arm's value (flags may hold JSON
    braces of their own, so no str.format)."""
    for k, v in params.items():
        flag = flag.replace("{" + k + "}", str(v))
    return flag


def _fmt(params: dict) -> str:
    return "(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else ""


def fixed_on(arm, engine: str, version: str | None = None):
    """`arm` plus what the engine does by default and no known setting turns off (unless
    a toggle of the arm already covers it): an engine configuration cannot be without
    those, so a design that drops a toggle gets them back explicitly, not silently."""
    add = []
    for name in load()["toggles"]:
        e = entry(name, engine, version)
        covered = name in arm or any(name in R.get(t).subsumes for t in arm.names)
        if e["default"] is True and e["off"] is None and not covered:
            add.append((name, e["params"]))
    return arm.with_(*add) if add else arm


def closest_items(engine: str, version: str | None = None) -> dict:
    """{toggle: params} of the arm an engine runs when every toggle with a known reference
    setting is set to it: its default arm minus the toggles some setting turns off
    (docs/research/engine-divergences.md §7). What remains is what no known setting can change
    (kernel_toggles.arms.reference_closest makes the arm)."""
    items = {}
    for name in load()["toggles"]:
        e = entry(name, engine, version)
        if e["default"] is True and e["off"] is None:
            items[name] = e["params"]
    subsumed = R.subsumed_by(items)
    return {n: p for n, p in items.items() if n not in subsumed}
