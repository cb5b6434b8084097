"""From an arm to its launch plan: the exact command line and environment (the engine's base
flags and env, the arm's toggles and serving settings translated through
kernel_toggles/engine_profiles.json for the engine's version, then the arm's own env and
flags, later ones winning) and the path that says it is ready. Running the plan (readiness,
logs, stopping the process group) is infra/server_process.py.

Research engine-integration.md §4: SGLang is ready when GET /health_generate answers 200
(it runs a one-token generation), vLLM when GET /health does."""
from __future__ import annotations

from infra.server_process import LaunchPlan
from kernel_toggles import serving_settings as SS

from fidelity import servers
from fidelity.servers.profiled import LaunchRefused

from .spec import EngineArm, EngineSpec, SpecError

EXTERNAL_READY = "/v1/models"        # a running server of any kind; a launched one: its module's ready_path


def plan_arm(arm: EngineArm, e: EngineSpec, captures: bool = False, max_logprobs: int | None = None) -> LaunchPlan:
    """The launch of one arm; refuses (SpecError naming the toggle) what the engine cannot
    be set to, and unconfirmed mappings unless the engine allows them."""
    if e.kind == "inprocess":                   # computed here, first (fidelity.engines.golden)
        return LaunchPlan(arm.name, e.name, e.kind, "", ready_path="", notes=[
            f"computed in this process on {','.join(e.devices)} ({e.model or 'the embedded model'}), "
            "scored and released before any engine is launched"])
    url = e.url if e.kind == "external" else f"http://{e.host}:{e.port}"
    ready = e.ready_path or (EXTERNAL_READY if e.kind == "external" else servers.get(e.kind).ready_path)
    p = LaunchPlan(arm.name, e.name, e.kind, url, ready_path=ready, start_timeout=e.start_timeout,
                   stop_grace=e.stop_grace)
    if e.kind == "external":
        if arm.toggles is not None or arm.env or arm.flags or arm.serving:
            raise SpecError(f"arm {arm.name}: engine {e.name} is external (already running); it "
                            "cannot be given toggles, serving settings, env or flags")
        return p
    env, flags = dict(e.env), list(e.flags)
    server = servers.get(e.kind)
    try:
        server.numerics(arm, e, env, flags, p.notes)
    except LaunchRefused as ex:
        raise SpecError(str(ex)) from None
    if arm.serving:
        _serving(arm, e, env, flags, p)
    flags += server.output_flags(captures, max_logprobs)
    env.update(arm.env)
    flags += arm.flags
    p.cmd, p.env = server.command(e) + flags, env
    return p


def _serving(arm: EngineArm, e: EngineSpec, env: dict, flags: list, p: LaunchPlan) -> None:
    """The arm's serving settings as the engine's flags and env (kernel_toggles.serving_settings);
    refused by name when the engine has no such setting, when the mapping is unconfirmed
    and the engine does not allow that, or when a base or arm flag / env var would fight it."""
    version = e.version if servers.get(e.kind).profiled else None
    where = f"arm {arm.name} on {e.kind}" + (f" {version}" if version else "")
    try:
        ls = SS.launch(arm.serving, e.kind, version)
        owned = {n: SS.controls(n, e.kind, version) for n in arm.serving}
    except ValueError as ex:
        raise SpecError(f"{where}: {ex}") from None
    if ls.refused:
        raise SpecError(f"{where}: " + "; ".join(f"serving setting {why}" for _, why in ls.refused)
                        + " (refused, not dropped)")
    if ls.unconfirmed and not e.allow_unconfirmed:
        raise SpecError(f"{where}: the mapping of serving setting {', '.join(ls.unconfirmed)} is UNCONFIRMED "
                        f"(see `fidelity toggles --serving --engine {e.kind}`); set allow_unconfirmed = true "
                        f"in [engines.{e.name}] to launch anyway")
    given = {f.split("=", 1)[0]: "flags" for f in list(flags) + arm.flags if f.startswith("--")}
    given.update({k: "env" for k in {**env, **arm.env}})
    for name, (fl, ev) in owned.items():
        clash = sorted((fl | ev) & set(given))
        if clash:
            raise SpecError(f"{where}: {clash[0]} is set in the engine's or the arm's {given[clash[0]]} and "
                            f"by serving setting {name}; set it one way only (serving = {{ {name} = ... }})")
    env.update(ls.env)
    flags += ls.flags
    p.notes += [f"serving setting {n}: unconfirmed mapping applied" for n in ls.unconfirmed]
