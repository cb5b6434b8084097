"""Numerics arms, as the in-process needle runner, `fidelity kld`'s in-process arms and
`fidelity serve` see them: a name, a way to make the arm's Numerics and the schedule its
prompts are fed with (`ARM@prefix_hit(128)`, reference_model.schedule). Arm strings (and
$DSV4_FIDELITY_ARM) are parsed by kernel_toggles."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from kernel_toggles import ENV_VAR, ToggleSet
from reference_model.schedule import ONESHOT, Schedule, ScheduleError


class ArmError(ValueError):
    """An arm string that cannot be parsed."""


@dataclass(frozen=True)
class NumericsArm:
    name: str                                   # canonical spelling, e.g. "golden"
    make_numerics: Callable[..., object]        # profile -> reference_model.Numerics
    toggles: tuple[str, ...] = ()               # each toggle's spelling, with its parameters
    schedule: Schedule = ONESHOT                # how its prompts are fed

    def numerics(self, profile: str = "reference", **numerics_kwargs):
        """The arm's Numerics (numerics_kwargs, e.g. compute_dtype, go to Numerics)."""
        return self.make_numerics(profile, **numerics_kwargs)


def split_schedule(text: str, default: str | None = None) -> tuple[str, Schedule]:
    """`engine@prefix_hit(128)` -> ("engine", prefix_hit(128)); without `@`, `default`."""
    arm, at, sched = text.partition("@")
    return arm, Schedule.parse(sched if at else (default or "oneshot"))


def check_schedules(schedules: dict[str, Schedule], lengths, held_back: int = 0) -> None:
    """ValueError naming every arm whose schedule cannot apply at these prompt lengths
    (Schedule.cannot_apply): such an arm would fail on each prompt and vanish from the
    tables (ab), or be counted as failing (needle), so it is refused before anything runs.
    `held_back`: tokens of each prompt fed after the scheduled prefill (needle prefills all
    but the last)."""
    problems = []
    for label, s in schedules.items():
        bad, why = s.cannot_apply([n - held_back for n in lengths])
        if bad:
            shown = ", ".join(str(n + held_back) for n in bad)
            fed = f" ({held_back} held back for the answer)" if held_back else ""
            problems.append(f"arm {label!r}: {s} cannot apply to prompts of {shown} tokens{fed} ({why})")
    if problems:
        raise ValueError("; ".join(problems) + "; change the schedule or the prompt lengths (--lengths)")


# numerics profiles an arm can pin with a prefix (reference_model.Numerics): `exact:` is the
# reference's math without its QAT simulation, what llama.cpp computes (docs/real-engines.md)
PROFILES = ("reference", "exact")


def pinned_profile(spec: str) -> tuple[str | None, str]:
    """'exact:kv_cache_ggml' -> ('exact', 'kv_cache_ggml'); no profile prefix -> (None, spec)."""
    head, sep, rest = spec.partition(":")
    return (head, rest) if sep and head in PROFILES else (None, spec)


def parse_arm(text: str | None, model: str = "v4") -> NumericsArm:
    """'golden' (or empty), 'engine', 'engine:sglang', 'kv_bf16,splitk_decode(splits=8)',
    'engine@chunked(64)', 'exact:expert_act_q8_0' (a pinned profile: the arm computes on it
    whatever profile its caller asks for), ...; `engine` spellings as for a `model` ('v4',
    'v41') checkpoint (kernel_toggles.arms.version_of of the config it runs)."""
    try:
        spec, schedule = split_schedule((text or "").strip())
        profile, spec = pinned_profile(spec.strip())
        ts = ToggleSet.parse(spec.strip(), model)
    except (ValueError, ScheduleError) as e:
        raise ArmError(str(e)) from None
    name = (f"{profile}:" if profile else "") + str(ts) + ("" if schedule == ONESHOT else f"@{schedule}")
    make = ts.numerics if profile is None else (lambda _=None, **kw: ts.numerics(profile, **kw))
    return NumericsArm(name, make, tuple(str(t) for t in ts), schedule)


def as_arm(x, model: str = "v4") -> NumericsArm:
    """A NumericsArm from a string (parsed for a `model` checkpoint), a NumericsArm, a
    ToggleSet-like object (has .numerics) or a callable profile -> Numerics."""
    if isinstance(x, NumericsArm):
        return x
    if x is None or isinstance(x, str):
        return parse_arm(x, model)
    if hasattr(x, "numerics"):
        return NumericsArm(str(x), x.numerics)
    if callable(x):
        return NumericsArm(getattr(x, "__name__", "custom"), x)
    raise ArmError(f"cannot make an arm from {x!r}")


def arm_from_env(environ=None, model: str = "v4") -> NumericsArm:
    env = os.environ if environ is None else environ
    try:
        return parse_arm(env.get(ENV_VAR, ""), model)
    except ArmError as e:
        raise ArmError(f"${ENV_VAR}: {e}") from None


def engine_arm() -> NumericsArm:
    """All optimization toggles."""
    return parse_arm("engine")
