"""The engines spec (TOML): engines (how to start one), arms (a configuration of one
engine: our toggles and/or the user's own env and flags), designs generated from a base
configuration, and the tasks to run on every arm. Every mistake is reported with the key
it is under.

    [run]
    baseline = "golden"            # an arm name
    tasks = ["kld", "needle"]
    out = "reports"                # output folder, relative to the current directory
                                   # (default "reports"; `--out DIR` overrides it)
    [run.kld]                      # fidelity kld options: lengths, depths, reps, top_k, steps, exact
                                   # (defaults: fidelity kld's, fidelity.kld.settings)
    [run.needle]                   # fidelity needle options: lengths, depths, reps, max_tokens, api, ...
    [run.consistency]              # fidelity consistency: families, reference, probes, length,
                                   # max_tokens, top_k, seed, concurrency, repeats, page_size, chunk_size,
                                   # retries, timeout, dialect; [run.consistency.<family>] for one family

    [engines.here]                 # arms computed in this process (the golden), not launched:
    kind = "inprocess"             # scored first, then released, then the engines launch
    devices = "cuda:0,cuda:1"      # required: where it runs ("cpu", or the GPUs it shares)
    model = "/models/DeepSeek-V4-Flash"   # a checkpoint (default: the embedded model)
    weights_mode = "dense"         # | streamed | resident-quantised
    accumulate = "auto"            # | fp64 | fp32

    [engines.sg]
    kind = "sglang"                # sglang | vllm | fidelity | llamacpp | external | inprocess
                                   # (llamacpp: model = a GGUF, served by the pinned llama-server;
                                   # its own flags (-ctk q8_0, -fa on, --no-repack ...) in flags;
                                   # an arm's toggles are its in-process twin's, on the exact
                                   # profile: "expert_act_q8_0,kv_cache_ggml(type=q8_0)" launches
                                   # -ctk/-ctv q8_0 (fidelity.llamacpp.flags), and -ctk q8_0 in
                                   # an arm's flags credits kv_cache_ggml in attribution)
    version = "0.5.23"             # mappings of toggles are per version
    model = "/models/DeepSeek-V4-Flash"
    port = 30000
    flags = ["--tp", "8"]
    env = { SGLANG_ENABLE_DETERMINISTIC_INFERENCE = "1" }
    start_timeout = 3600
    allow_unconfirmed = false      # toggles whose mapping the research marks UNCONFIRMED
    serving = { max_running_requests = 64 }   # every arm's serving settings (an arm's value wins)

    [[arms]]
    name = "default"
    engine = "sg"
    toggles = "engine:sglang"      # our arm syntax; "closest" = every known reference
                                   # setting applied; omit for the engine as started
    env = {}; flags = []; role = "arm"   # role: arm | floor
    serving = { mtp = 0, cuda_graphs = false }
                                   # launch-only serving settings (kernel_toggles/serving_settings.py:
                                   # mtp, cuda_graphs, prefix_cache, chunked_prefill_size, deterministic,
                                   # max_running_requests), mapped to flags/env per engine version

    [[designs]]                    # arms generated from a base configuration
    engine = "sg"
    kind = "one-at-a-time"         # | leave-one-out | factorial
    base = "engine:sglang"
    toggles = ["kv_fp8_from_fp32", "wo_a_fp8"]   # default: the base's toggles
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fidelity import servers
from kernel_toggles import ToggleSet, profiles
from kernel_toggles import arms as K
from kernel_toggles import serving_settings as SS
from kernel_toggles.arms import reference_closest

KINDS = servers.launchable() + ("external", "inprocess")
# what an in-process engine takes: it is computed here, so nothing about a launch applies
INPROCESS_KEYS = ("kind", "model", "devices", "weights_mode", "accumulate")
DESIGNS = ("one-at-a-time", "leave-one-out", "factorial")
TASKS = ("kld", "needle", "consistency")


class SpecError(ValueError):
    pass


@dataclass
class EngineSpec:
    name: str
    kind: str
    version: str | None = None
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    url: str | None = None                       # external only
    api_key_env: str | None = None               # the variable holding its API key (sent as a bearer token)
    python: str = "python3"
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 3600.0
    stop_grace: float = 30.0
    ready_path: str | None = None
    allow_unconfirmed: bool = False
    serving: dict = field(default_factory=dict)  # serving settings every arm starts from
    devices: tuple[str, ...] | None = None       # inprocess only: where its arms are computed
    weights_mode: str = "dense"                  # inprocess only (fidelity.weights.source)
    accumulate: str = "auto"                     # inprocess only (fidelity.weights.devices)


@dataclass
class EngineArm:
    """An arm of an engines run: one engine started with our toggles and/or the user's env
    and flags."""
    name: str
    engine: str
    toggles: object | None = None                # kernel_toggles ToggleSet, None = as started
    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    role: str = "arm"                            # baseline | arm | floor
    factors: frozenset = field(default_factory=frozenset)
    serving: dict = field(default_factory=dict)  # serving settings: the engine's, then the arm's


@dataclass
class Spec:
    path: Path
    engines: dict[str, EngineSpec]
    arms: list[EngineArm]                           # the baseline first
    tasks: list[str]
    kld: dict
    needle: dict
    out: str
    consistency: dict = field(default_factory=dict)


def _str_dict(v, where) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, (str, int, float, bool))
                                          for k, x in v.items()):
        raise SpecError(f"{where} must be a table of NAME = value")
    return {k: str(x).lower() if isinstance(x, bool) else str(x) for k, x in v.items()}


def _str_list(v, where) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) for x in v):
        raise SpecError(f"{where} must be a list of strings")
    return [str(x) for x in v]


def _only(d: dict, allowed, where):
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise SpecError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _engine(name: str, d: dict) -> EngineSpec:
    where = f"engines.{name}"
    if not isinstance(d, dict):
        raise SpecError(f"{where} must be a table")
    kind = d.get("kind")
    if kind not in KINDS:
        raise SpecError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "inprocess":
        return _inprocess(name, d)
    bad = sorted(set(d) & (set(INPROCESS_KEYS) - {"kind", "model"}))
    if bad:
        raise SpecError(f"{where}.{bad[0]}: only an engine of kind \"inprocess\" takes it (a {kind} engine "
                        "is launched; give its placement through its own flags)")
    _only(d, EngineSpec.__dataclass_fields__.keys() - {"name", "ready_path"} - set(INPROCESS_KEYS)
          | {"ready", "kind", "model"}, where)
    e = EngineSpec(name, kind)
    for k in ("version", "model", "host", "url", "python", "api_key_env"):
        if k in d:
            if not isinstance(d[k], str):
                raise SpecError(f"{where}.{k} must be a string")
            setattr(e, k, d[k])
    if "port" in d:
        if not isinstance(d["port"], int) or not 0 < d["port"] < 65536:
            raise SpecError(f"{where}.port must be a port number, got {d['port']!r}")
        e.port = d["port"]
    for k in ("start_timeout", "stop_grace"):
        if k in d:
            if not isinstance(d[k], (int, float)) or d[k] <= 0:
                raise SpecError(f"{where}.{k} must be a positive number of seconds")
            setattr(e, k, float(d[k]))
    e.flags = _str_list(d.get("flags", []), f"{where}.flags")
    e.env = _str_dict(d.get("env", {}), f"{where}.env")
    e.ready_path = d.get("ready")
    e.allow_unconfirmed = bool(d.get("allow_unconfirmed", False))
    e.serving = _serving(d.get("serving", {}), f"{where}.serving")
    if kind == "external" and not e.url:
        raise SpecError(f"{where}: an external engine needs url")
    server = servers.find(kind)
    lacks = server.check(e, where) if server else None
    if lacks:
        raise SpecError(lacks)
    return e


def _inprocess(name: str, d: dict) -> EngineSpec:
    """An engine computed in this process: where (devices: required, since what the golden
    shares with the launched engines is the point), the checkpoint, how its weights are held
    and the accumulation dtype. Device names are checked here; that they exist, at run."""
    from fidelity.weights.devices import DeviceError, parse_devices
    from fidelity.weights.source import WEIGHT_MODES
    where = f"engines.{name}"
    extra = sorted(set(d) - set(INPROCESS_KEYS))
    if extra:
        raise SpecError(f"{where}.{extra[0]}: an inprocess engine is computed in this process, nothing is "
                        f"launched, so it takes no {extra[0]} (allowed: {', '.join(INPROCESS_KEYS)})")
    e = EngineSpec(name, "inprocess", host="", port=0)
    if "model" in d:
        if not isinstance(d["model"], str) or not d["model"]:
            raise SpecError(f"{where}.model must be a checkpoint path or an embedded model's name")
        e.model = d["model"]
    if "devices" not in d:
        raise SpecError(f"{where}: an inprocess engine needs devices: where its arms are computed, \"cpu\" "
                        "or the GPUs it shares with the launched engines, e.g. \"cuda:0,cuda:1\" (they are "
                        "scored and released before any engine is launched)")
    v = d["devices"]
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
        raise SpecError(f"{where}.devices must be a string (\"cuda:0,cuda:1\") or a list of device names")
    if not (v.strip() if isinstance(v, str) else [x for x in v if x.strip()]):
        raise SpecError(f"{where}.devices is empty: give \"cpu\" or the GPUs, e.g. \"cuda:0,cuda:1\"")
    try:
        e.devices = parse_devices(v, on_this_machine=False)
    except DeviceError as ex:
        raise SpecError(f"{where}.devices: {str(ex).removeprefix('--devices: ')}") from None
    e.weights_mode = d.get("weights_mode", "dense")
    if e.weights_mode not in WEIGHT_MODES:
        raise SpecError(f"{where}.weights_mode must be one of {', '.join(WEIGHT_MODES)}, got {e.weights_mode!r}")
    e.accumulate = d.get("accumulate", "auto")
    if e.accumulate not in ("auto", "fp64", "fp32"):
        raise SpecError(f"{where}.accumulate must be auto, fp64 or fp32, got {e.accumulate!r}")
    return e


def _serving(d, where) -> dict:
    try:
        return SS.parse(d, where)
    except SS.ServingError as e:
        raise SpecError(str(e)) from None


def _model_of(e: EngineSpec) -> str:
    """The model version `engine` spellings of an engine's arms resolve for: an in-process
    engine's checkpoint's ('v41' for a DeepSeek-V4.1 config.json, read here, before anything
    runs); 'v4' for launched engines (their checkpoint is the engine's to read) and for a
    checkpoint not found (the run names it when it loads it)."""
    if e.kind != "inprocess" or not e.model:
        return "v4"
    from fidelity.weights.source import WeightsError, resolve_checkpoint
    from reference_model.v41.config import any_config_from_file
    try:
        path = resolve_checkpoint(e.model) / "config.json"
    except WeightsError:
        return "v4"
    return K.version_of(any_config_from_file(path)) if path.is_file() else "v4"


def _toggles(text, where, model: str = "v4"):
    if text is None:
        return None
    if not isinstance(text, str):
        raise SpecError(f"{where} must be an arm string, e.g. \"engine:sglang\"")
    try:
        return ToggleSet.parse(text, model)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def _closest(e: EngineSpec, where: str):
    """toggles = "closest": the engine with every known reference setting applied."""
    server = servers.find(e.kind)
    if not (server and server.profiled):
        profiled = " or ".join(n for n, s in servers.REGISTRY.items() if s.profiled)
        raise SpecError(f"{where}: \"closest\" needs an engine whose toggles map through profiles ({profiled})")
    try:
        return reference_closest(e.kind, e.version)
    except ValueError as ex:
        raise SpecError(f"{where}: {ex}") from None


def _arm(i: int, d: dict, engines) -> EngineArm:
    where = f"arms[{i}]"
    _only(d, {"name", "engine", "toggles", "env", "flags", "role", "factors", "serving"}, where)
    name, eng = d.get("name"), d.get("engine")
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ "):
        raise SpecError(f"{where}.name must be a non-empty name without / or spaces")
    if eng not in engines:
        raise SpecError(f"{where} ({name}).engine {eng!r} is not one of the engines "
                        f"({', '.join(engines) or 'none'})")
    role = d.get("role", "arm")
    if role not in ("arm", "floor"):
        raise SpecError(f"{where}.role must be arm or floor")
    if d.get("toggles") == "closest":
        ts = _closest(engines[eng], f"{where}.toggles")
    else:
        ts = _toggles(d.get("toggles"), f"{where}.toggles", _model_of(engines[eng]))
    env = _str_dict(d.get("env", {}), f"{where}.env")
    flags = _str_list(d.get("flags", []), f"{where}.flags")
    own = _serving(d.get("serving", {}), f"{where}.serving")
    if engines[eng].kind == "inprocess" and (env or flags or own):
        raise SpecError(f"{where} ({name}): engine {eng} is computed in this process (kind \"inprocess\"); "
                        "its arms take toggles only, not env, flags or serving settings")
    factors = d.get("factors")
    if factors is None:              # what attribution credits: the toggles, plus the patch
        factors = set(ts.names) if ts is not None else set()
        patched = env or flags or own
        read = _flag_factors(engines[eng], env, flags, f"{where} ({name})") if ts is None else None
        if read is not None:
            factors, patched = read[0], own or read[1]
        if patched or not factors:
            factors.add(name)
    serving = {**engines[eng].serving, **own}
    return EngineArm(name, eng, ts, env, flags, role, frozenset(_str_list(list(factors), f"{where}.factors")),
                     {n: serving[n] for n in SS.SETTINGS if n in serving})


def _flag_factors(e: EngineSpec, env: dict, flags: list, where: str) -> tuple[set, bool] | None:
    """The toggles an arm's own flags and env set away from its engine's defaults, for an
    engine whose flags are read as toggles (llama.cpp's `-ctk q8_0`): what attribution
    credits; None for the others."""
    server = servers.find(e.kind)
    if server is None:
        return None
    try:
        return server.flag_factors(flags, env)
    except ValueError as ex:
        raise SpecError(f"{where}: {ex}") from None


def _design(i: int, d: dict, engines) -> list[EngineArm]:
    where = f"designs[{i}]"
    _only(d, {"engine", "kind", "base", "toggles", "prefix"}, where)
    if d.get("engine") not in engines:
        raise SpecError(f"{where}.engine {d.get('engine')!r} is not one of the engines")
    kind = d.get("kind")
    if kind not in DESIGNS:
        raise SpecError(f"{where}.kind must be one of {', '.join(DESIGNS)}, got {kind!r}")
    base = _toggles(d.get("base", "engine"), f"{where}.base", _model_of(engines[d["engine"]]))
    names = _str_list(d.get("toggles", list(base.names)), f"{where}.toggles")
    prefix = d.get("prefix", d["engine"])
    if kind == "one-at-a-time":
        named = [(f"+{n}", ToggleSet.parse(n)) for n in names]
    elif kind == "leave-one-out":
        bad = [n for n in names if n not in base]
        if bad:
            raise SpecError(f"{where}: {bad[0]} is not in the base {base}")
        named = [("base", base)] + [(f"-{n}", base.without(n)) for n in names]
    else:
        if len(names) > 6:
            raise SpecError(f"{where}: a factorial over {len(names)} toggles is {2 ** len(names)} "
                            "engine launches; give at most 6")
        named = [("+".join(ts.names) or "none", ts) for ts in K.factorial(names)]
    e = engines[d["engine"]]
    out = []
    for label, ts in named:
        if (server := servers.find(e.kind)) and server.profiled:
            try:
                ts = profiles.fixed_on(ts, e.kind, e.version)
            except ValueError as ex:
                raise SpecError(f"{where}: {ex}") from None
        out.append(EngineArm(f"{prefix}:{label}", d["engine"], ts, factors=frozenset(ts.names),
                             serving=dict(e.serving)))
    return out


def load_spec(path: str | Path) -> Spec:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec not found: {p}")
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{p}: not valid TOML: {e}") from None
    _only(d, {"run", "engines", "arms", "designs"}, str(p))
    run = d.get("run", {})
    _only(run, {"baseline", "tasks", "kld", "needle", "consistency", "out"}, "run")
    engines = {n: _engine(n, e) for n, e in (d.get("engines") or {}).items()}
    if not engines:
        raise SpecError(f"{p}: no [engines.NAME] table")
    here = [n for n, e in engines.items() if e.kind == "inprocess"]
    if len(here) > 1:
        raise SpecError(f"engines {', '.join(here)} are both of kind \"inprocess\": give one (its arms share "
                        "its weights, devices and release)")
    arms = [_arm(i, a, engines) for i, a in enumerate(d.get("arms") or [])]
    for i, g in enumerate(d.get("designs") or []):
        arms += _design(i, g, engines)
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"arm names repeat: {', '.join(dup)}")
    if not arms:
        raise SpecError(f"{p}: no arms ([[arms]] or [[designs]])")
    base = run.get("baseline", names[0])
    if base not in names:
        raise SpecError(f"run.baseline {base!r} is not an arm ({', '.join(names)})")
    b = arms.pop(names.index(base))
    b.role, b.factors = "baseline", frozenset()
    tasks = _str_list(run.get("tasks", ["kld"]), "run.tasks")
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SpecError(f"run.tasks: unknown task {bad[0]!r} (tasks: {', '.join(TASKS)})")
    for k in ("kld", "needle", "consistency"):
        if not isinstance(run.get(k, {}), dict):
            raise SpecError(f"run.{k} must be a table")
    return Spec(p, engines, [b] + arms, tasks, run.get("kld", {}), run.get("needle", {}),
                run.get("out", "reports"), run.get("consistency", {}))
