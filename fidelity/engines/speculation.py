"""The consistency `spec` family in an engines run: arms that decode speculatively
(`serving = { mtp = K }`, K > 0) against a baseline arm serving the same model without it.

Engines run one at a time, so the family records each arm's replies in the shared probe
store (fidelity.consistency.spec) and compares them with the baseline's: the baseline is
launched before any speculative arm, and arms that are neither are not asked. The baseline
is `[run.consistency.spec] baseline = "NAME"`, else the first launched arm without `mtp`."""
from __future__ import annotations

from dataclasses import replace

from .golden import launched
from .spec import Spec, SpecError


def speculates(arm) -> bool:
    return bool(arm.serving.get("mtp", 0))


def spec_baseline(spec: Spec, name) -> str:
    """The baseline arm's name, checked: a launched arm that does not speculate, with at
    least one launched arm that does."""
    arms = launched(spec)
    if not any(speculates(a) for a in arms):
        raise SpecError("run.consistency: the spec family compares arms that decode speculatively with "
                        "a baseline that does not, and no launched arm has serving = { mtp = K } (K >= 1)")
    if name is None:
        plain = [a for a in arms if not speculates(a)]
        if not plain:
            raise SpecError("run.consistency: the spec family needs a baseline arm without speculation "
                            "(serving mtp = 0) beside the arms with it; every launched arm has mtp > 0")
        return plain[0].name
    if not isinstance(name, str):
        raise SpecError(f"run.consistency.spec.baseline must be an arm name, got {name!r}")
    arm = next((a for a in spec.arms if a.name == name), None)
    if arm is None:
        raise SpecError(f"run.consistency.spec.baseline {name!r} is not an arm "
                        f"(arms: {', '.join(a.name for a in spec.arms)})")
    if arm not in arms:
        raise SpecError(f"run.consistency.spec.baseline {name!r} is computed in-process, not served: the "
                        "spec family compares served replies; name a launched arm without mtp")
    if speculates(arm):
        raise SpecError(f"run.consistency.spec.baseline {name!r} decodes speculatively itself "
                        f"(mtp = {arm.serving['mtp']}); the baseline must serve without it")
    return name


def launch_order(spec: Spec, cs) -> list:
    """The launched arms in spec order, except that the spec family's baseline goes before
    the first speculative arm (their replies are compared with its recorded ones)."""
    arms = launched(spec)
    if cs is None or "spec" not in cs.families:
        return arms
    base = next(a for a in arms if a.name == cs.spec.baseline)
    first = next(i for i, a in enumerate(arms) if speculates(a))
    if arms.index(base) < first:
        return arms
    rest = [a for a in arms if a is not base]
    return rest[:first] + [base] + rest[first:]


def settings_for(arm, cs):
    """The consistency settings one arm is probed with: the spec family only on the
    baseline and the speculative arms."""
    if "spec" not in cs.families or speculates(arm) or arm.name == cs.spec.baseline:
        return cs
    return replace(cs, families=tuple(f for f in cs.families if f != "spec"))
