"""What SGLang and vLLM share as launched engines: toggle mappings per engine version
(kernel_toggles/engine_profiles.json), so a block needs model and version; their profiled
defaults are their twin (`engine:<name>`)."""
from __future__ import annotations

from kernel_toggles import profiles

from .base import Server


class LaunchRefused(ValueError):
    """An arm this engine cannot be set to (the message names the toggle)."""


class Profiled(Server):
    profiled = True
    launch_needs = "model and version (toggle mappings are per version)"

    def check(self, e, where):
        if not (e.model and e.version):
            return f"{where}: a {self.name} engine needs {self.launch_needs}"
        return None

    def twin_of_endpoint(self, ep):
        return f"engine:{self.name}", f"{self.name}'s profiled defaults (kernel_toggles/engine_profiles.json)"

    def twin_of_arm(self, e, arm):
        if arm.toggles is not None:
            return str(arm.toggles) or "golden", "the arm's toggles"
        return self.twin_of_endpoint(None)

    def numerics(self, arm, e, env, flags, notes):
        if arm.toggles is None:
            return
        try:
            ls = profiles.launch_settings(arm.toggles, e.kind, e.version)
        except ValueError as ex:
            raise LaunchRefused(f"arm {arm.name}: {ex}") from None
        if ls.unrealisable:
            raise LaunchRefused(f"arm {arm.name} on {e.kind} {e.version}: " + "; ".join(
                f"{t}: {why}" for t, why in ls.unrealisable) + " (no mapping: refused, not dropped)")
        risky = [t for t in ls.applied if t in ls.unconfirmed]
        if risky and not e.allow_unconfirmed:
            raise LaunchRefused(f"arm {arm.name} on {e.kind} {e.version}: the settings for "
                                f"{', '.join(risky)} are UNCONFIRMED in the research; set "
                                f"allow_unconfirmed = true in [engines.{e.name}] to launch anyway")
        env.update(ls.env)
        flags += ls.flags
        notes += [f"unconfirmed mapping applied: {t}" for t in risky]
        notes += [f"engine behaviour unknown, nothing set: {t}" for t in ls.unknown]
        notes += [f"behaviour assumed (engine default, unconfirmed): {t}"
                  for t in ls.unconfirmed if t not in ls.applied]
