"""Serving settings: engine launch settings that change how requests are served, not the
numerics of one sequence on its own -- speculative decoding with the checkpoint's MTP layer,
CUDA graphs, the prefix cache, the prefill chunk, deterministic / batch-invariant mode, the
cap on running requests.

They have no golden kernel, so they are not toggles (a toggle replaces a reference kernel
and has an in-process golden; the `serving` category toggles in kernel_toggles.serving do).
An engines arm carries them as `serving = {mtp = 0, cuda_graphs = false}`; each is checked
by name and value here, and engine_profiles.json["serving_settings"] says which flags and
env vars realise it on each engine (per version, like the toggles' mappings). What they do
to the answers is measured by the engines `consistency` task (fidelity consistency), and
their effect on the numerics by the `kld` task against a baseline arm."""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field

from . import profiles
from .registry import ToggleError

ENGINES = ("sglang", "vllm", "fidelity", "llamacpp")
PLACEHOLDERS = ("{value}", "{value_plus_1}")


class ServingError(ToggleError):
    """Unknown serving setting, bad value, or no setting on an engine."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                   # "bool" | "count"
    minimum: int = 0            # count only
    bool_ok: bool = False       # count only: false = 0, true = 1
    unit: str = ""
    description: str = ""

    def check(self, value, where: str = "serving"):
        """The value, normalised (a count as int); ServingError naming the setting otherwise."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ServingError(f"{where}.{self.name} takes true or false, got {value!r}")
            return value
        if isinstance(value, bool):
            if self.bool_ok:
                return int(value)
            raise ServingError(f"{where}.{self.name} takes a number of {self.unit} >= {self.minimum}, "
                               f"got {value!r}")
        if not isinstance(value, int) or value < self.minimum:
            extra = " (or true / false)" if self.bool_ok else ""
            raise ServingError(f"{where}.{self.name} takes a number of {self.unit} >= {self.minimum}{extra}, "
                               f"got {value!r}")
        return value

    def spell(self, value) -> str:
        if self.kind == "bool":
            return "true" if value else "false"
        return str(value) + (" (off)" if value == 0 else "")


SETTINGS = {s.name: s for s in (
    Setting("mtp", "count", 0, True, "draft tokens",
            "Speculative decoding with the checkpoint's MTP layer as the draft: N draft tokens per "
            "step, verified by the main model (0 or false: off; true: 1)."),
    Setting("cuda_graphs", "bool", description="Decode (and prefill) replayed from captured CUDA graphs "
            "(true) or run eagerly (false)."),
    Setting("prefix_cache", "bool", description="Reuse of a cached prompt prefix across requests "
            "(SGLang's radix cache, vLLM's prefix caching)."),
    Setting("chunked_prefill_size", "count", 1, unit="tokens",
            description="Longest prefill step: longer prompts are prefilled in chunks of this many tokens."),
    Setting("deterministic", "bool", description="The engine's deterministic / batch-invariant mode "
            "(the same request gives the same answer whatever else is in flight)."),
    Setting("max_running_requests", "count", 1, unit="requests",
            description="Most requests decoded together in one batch; the rest wait."),
)}


def get(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), SETTINGS, 1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ServingError(f"unknown serving setting {name!r}{hint} (known: {', '.join(SETTINGS)}; "
                           "`fidelity toggles --serving` lists them)") from None


def parse(d, where: str = "serving") -> dict:
    """{name: value} from a spec table, names and values checked, in the registry's order."""
    if not isinstance(d, dict):
        raise ServingError(f"{where} must be a table of setting = value, e.g. "
                           "{ mtp = 0, cuda_graphs = false }")
    out = {}
    for name, v in d.items():
        try:
            s = get(name)
        except ServingError as e:
            raise ServingError(f"{where}: {e}") from None
        out[name] = s.check(v, where)
    return {n: out[n] for n in SETTINGS if n in out}


@functools.lru_cache(maxsize=1)
def _checked() -> dict:
    data = profiles.load()
    errs = validate(data)
    if errs:
        raise ServingError(f"{profiles.PATH}: " + "; ".join(errs))
    return data.get("serving_settings", {})


def validate(data: dict) -> list[str]:
    errs = []
    sv = data.get("serving_settings", {})
    for name in sv:
        if name not in SETTINGS:
            errs.append(f"serving_settings: unknown setting {name!r}")
    for s in SETTINGS.values():
        if s.name not in sv:
            errs.append(f"serving setting {s.name} has no profile entry")
            continue
        for eng in ENGINES:
            e = sv[s.name].get(eng)
            if e is None:
                errs.append(f"serving_settings.{s.name}: no {eng} entry")
                continue
            if e.get("default") is not None:
                try:
                    s.check(e["default"])
                except ServingError as ex:
                    errs.append(f"serving_settings.{s.name}.{eng}.default: {ex}")
            errs += profiles.mapping_errors(f"serving_settings.{s.name}.{eng}", e, eng, data)
    return errs


def entry(name: str, engine: str, version: str | None = None) -> dict:
    """A setting's mapping on an engine; with a version, that version's overrides applied
    (a version with no mappings is an error, as for toggles)."""
    get(name)
    if engine not in ENGINES:
        raise ServingError(f"unknown engine {engine!r} for serving settings; valid: {', '.join(ENGINES)}")
    e = _checked()[name][engine]
    if version is None or engine == "fidelity":
        return e
    return {**e, **e.get("by_version", {}).get(profiles.profile_version(engine, version), {})}


def _fill(text: str, value: int) -> str:
    return text.replace("{value_plus_1}", str(value + 1)).replace("{value}", str(value))


@dataclass
class ServingLaunch:
    env: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    applied: list = field(default_factory=list)        # settings with something in env / flags
    unconfirmed: list = field(default_factory=list)    # settings whose mapping is unconfirmed
    refused: list = field(default_factory=list)        # (setting, reason)


def launch(settings: dict, engine: str, version: str | None = None) -> ServingLaunch:
    """The env vars and flags that set `settings` ({name: checked value}) on `engine`."""
    out = ServingLaunch()
    for name, value in settings.items():
        s = get(name)
        value = s.check(value)
        e = entry(name, engine, version)
        side = "on" if value else "off"
        need = e[side]
        if need is None:
            what = f"{name} = {s.spell(value)}"
            out.refused.append((name, f"no known {engine} setting for {what}"
                                      + (f" ({e['note']})" if e.get("note") else "")))
            continue
        v = int(value)
        env = {k: _fill(str(x), v) for k, x in need.get("env", {}).items()}
        flags = [_fill(str(f), v) for f in need.get("flags", [])]
        out.env.update(env)
        out.flags += flags
        if env or flags:
            out.applied.append(name)
        if e["unconfirmed"]:
            out.unconfirmed.append(name)
    return out


def controls(name: str, engine: str, version: str | None = None) -> tuple[set, set]:
    """(flag names, env names) a setting's mapping on `engine` can write: a base flag or env
    var of the same name would fight it."""
    e = entry(name, engine, version)
    flags, env = set(), set()
    for side in ("on", "off"):
        x = e.get(side) or {}
        flags |= {f.split("=", 1)[0] for f in x.get("flags", []) if f.startswith("--")}
        env |= set(x.get("env", {}))
    return flags, env


def _settings_text(d) -> str:
    if d is None:
        return "(no known setting)"
    parts = [f"{k}={v}" for k, v in d.get("env", {}).items()] + list(d.get("flags", []))
    return " ".join(parts) or "(nothing to set)"


def render_text(engine: str | None = None) -> str:
    """The settings, what each means, and their mapping on each engine (or one)."""
    lines = []
    for s in SETTINGS.values():
        kind = "true/false" if s.kind == "bool" else f"count of {s.unit} >= {s.minimum}" + (
            ", or true/false" if s.bool_ok else "")
        lines.append(f"{s.name} ({kind})")
        lines.append(f"  {s.description}")
        for eng in ([engine] if engine else ENGINES):
            vs = profiles.versions(eng) if eng in profiles.ENGINES else []
            e = entry(s.name, eng, vs[-1] if vs else None)
            label = f"{eng} {vs[-1]}" if vs else eng
            default = "unknown / resolved at start-up" if e["default"] is None else (
                s.spell(e["default"]) if s.kind == "bool" else str(e["default"]))
            lines.append(f"  {label}: default {default}; on: {_settings_text(e['on'])}; "
                         f"off: {_settings_text(e['off'])}{'  UNCONFIRMED' if e['unconfirmed'] else ''}")
            if engine:
                lines.append(f"    {e['note']}")
    return "\n".join(lines) + "\n"
