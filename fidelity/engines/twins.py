"""`fidelity engines`' second judgement: each launched arm against its twin, as `fidelity
kld` does (fidelity.kld.twin). The twin is known from the spec before anything launches,
so the in-process engine scores it (and the floors around it) with the golden, and each
arm with a twin is scored twice (its own run-to-run noise, a floor of that judgement).

An arm's twin: its `toggles` when the spec gives them (llama.cpp: on the exact profile,
as its launch reads them); else llama.cpp's flags and env mapped to toggles
(fidelity.llamacpp.flags), SGLang's / vLLM's profiled defaults (`engine:<kind>`), and
nothing for `fidelity serve` as started (it serves the golden: the first judgement says
it all) or an external server (nothing to derive one from)."""
from __future__ import annotations

from fidelity import servers
from fidelity.design.arms import parse_arm
from fidelity.kld.twin import Twin

from .spec import Spec


def spelling_of(spec: Spec, arm) -> tuple[str, str] | None:
    """(twin spelling, where it came from) of a launched arm, or None (its engine's module
    says: fidelity.servers)."""
    e = spec.engines[arm.engine]
    server = servers.find(e.kind)
    return server.twin_of_arm(e, arm) if server else None


def engine_twins(spec: Spec, version: str) -> list[Twin]:
    """The twins of the launched arms (one per distinct arm, named as fidelity kld names
    them); none unless the baseline is computed in-process (the twin needs the weights)."""
    if spec.engines[spec.arms[0].engine].kind != "inprocess":
        return []
    base = parse_arm(str(spec.arms[0].toggles) if spec.arms[0].toggles is not None else "golden", version).name
    by: dict[str, Twin] = {}
    for a in spec.arms[1:]:
        if spec.engines[a.engine].kind == "inprocess" or a.role == "floor":
            continue
        got = spelling_of(spec, a)
        if got is None:
            continue
        name = parse_arm(got[0], version).name
        if name != base:
            by.setdefault(name, Twin(name, got[1])).engines.append(a.name)
    twins = list(by.values())
    taken = {a.name for a in spec.arms}
    for t in twins:
        t.name = "twin" if len(twins) == 1 else f"twin-{t.engines[0]}"
        while t.name in taken:
            t.name += "~twin"
    return twins


def with_twin(spec: Spec, version: str) -> set[str]:
    """The launched arms that have a twin (each is scored twice)."""
    return {e for t in engine_twins(spec, version) for e in t.engines}
