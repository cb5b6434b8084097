"""`fidelity ab`'s settings and arms: golden, three noise floors (QAT: reference vs exact;
reduction order: fp32 vs fp64 accumulation; indexer tie order: top-k ties broken towards
the higher index), every optimization alone, the engine (all optimizations) and the
engine minus each; other checkpoints as `weights:<name>` arms; and the factorial stage
over the toggles with the largest effects, so Shapley values are exact there."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from infra.command import command_line
from kernel_toggles import arms as K
from reference_model import Numerics
from reference_model.numerics import topk_highest_index_ties

from reference_model.schedule import ONESHOT, Schedule

from ..design.arms import split_schedule

from ..verdict.signals import QAT_FLOOR, SCHEDULE_FACTOR
from .lockstep import LockstepArm
from .runner_settings import RunnerSettings

GOLDEN = "golden"
FLOOR = QAT_FLOOR                  # reference vs exact: the QAT noise floor (verdict, attribution)
FLOOR_ORDER = "floor:fp32-accum"   # fp32 instead of fp64 accumulation: reduction-order noise
FLOOR_TIES = "floor:tie-order"     # indexer top-k ties broken the other way (torch.topk leaves it open)
FLOORS = (FLOOR, FLOOR_ORDER, FLOOR_TIES)
FLOOR_SCHEDULE = "floor:schedule"  # golden under a schedule (floor:schedule@prefix_hit(128)) vs one-shot
LONG_LENGTHS = (250, 511, 2047)    # --long: 2047 tokens = 511 CSA entries = 32x the tiny index_topk
WEIGHTS_PREFIX = "weights:"


@dataclass(frozen=True)
class ArmDesign:
    """Which arms run: the default design around `base`, or explicit arms."""
    arms: list[str] | None = None          # extra/explicit arms (ToggleSet syntax); None = default design
    base: str = "engine"                   # arm whose leave-one-out is computed
    vs: str | None = None                  # first divergence also against this arm
    shapley_top: int = 3                   # factorial stage over this many toggles (0 = off)
    weights_variants: tuple = ()           # ((name, label), ...): other checkpoints as arms
    schedule: str | None = None            # every toggle arm fed this way (arm@schedule overrides)


@dataclass(frozen=True)
class PromptPlan:
    """The built-in prompts (lengths x prompts per length from `seed`) or the user's file."""
    lengths: tuple[int, ...] = (250, 511)     # residues 2 and 3 mod 4: partial compressor groups
    # 9: 18 prompts x 2 CSA layers (tiny) = 36 needle trials, so the exact test names a
    # needle-entry loss in 1 of 5 trials with power ~0.87 (3 per length: 12 trials, ~0.07)
    prompts_per_length: int = 9
    seed: int = 0
    prompts_file: str | None = None        # the user's prompts (JSONL) instead of the built-in ones


@dataclass(frozen=True)
class Statistics:
    """Bootstrap resamples and seed, and the floor multiple that counts as a divergence."""
    n_boot: int = 1000
    floor_k: float = 2.0
    seed: int = 0


_PARTS = {"design": ArmDesign, "prompts": PromptPlan, "runner": RunnerSettings, "stats": Statistics}


@dataclass(frozen=True)
class ABSettings:
    """One run's settings, by concern."""
    design: ArmDesign = field(default_factory=ArmDesign)
    prompts: PromptPlan = field(default_factory=PromptPlan)
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    stats: Statistics = field(default_factory=Statistics)
    checkpoint: str = "embedded:tiny-random(seed=0)"
    command_line: str = field(default_factory=command_line)

    @classmethod
    def of(cls, checkpoint: str = "embedded:tiny-random(seed=0)", **fields) -> "ABSettings":
        """Settings from flat field names, each routed to its part (`seed` sets the prompts'
        and the bootstrap's); an unknown name is an error."""
        parts = {name: {} for name in _PARTS}
        for key, value in fields.items():
            owners = [name for name, part in _PARTS.items() if key in part.__dataclass_fields__]
            if not owners:
                raise TypeError(f"ABSettings has no setting {key!r}")
            for name in owners:
                parts[name][key] = value
        return cls(**{name: _PARTS[name](**kw) for name, kw in parts.items()}, checkpoint=checkpoint)


def arm_sets(settings: ABSettings, model: str = "v4") -> tuple[dict[str, object], list[str], dict[str, Schedule]]:
    """Arm label -> ToggleSet, the toggles attribution ranges over, and each arm's schedule
    (`arm@S`, or --schedule for all). A schedule is a factor of the arms under it but never
    a suspect: it is context (the verdict's `under_schedule` effects), and what golden
    itself does under it is the floor `floor:schedule@S`. `engine` spellings are the
    `model` version's (kernel_toggles.arms.version_of: 'v4' or 'v41')."""
    d = settings.design
    default = Schedule.parse(d.schedule or "oneshot")
    at = "" if default == ONESHOT else f"@{default}"
    base = K.ToggleSet.parse(d.base, model)
    arms: dict[str, object] = {}
    schedules: dict[str, Schedule] = {}
    if d.arms is None:
        for s in K.one_at_a_time(base):
            arms[str(s) + at] = s
        arms[d.base + at] = base
        named_base = K.is_engine_spelling(d.base)
        for drop in base.names:               # ASCII names that parse back: engine-x
            arms[(f"{d.base}-{drop}" if named_base else str(base.without(drop))) + at] = base.without(drop)
        schedules = dict.fromkeys(arms, default)
    else:
        for text in d.arms:
            name, sched = split_schedule(text, d.schedule)
            ts = K.ToggleSet.parse(name, model)
            label = name if name.startswith("engine") else str(ts)
            label += "" if sched == ONESHOT else f"@{sched}"
            arms[label], schedules[label] = ts, sched
        _with_oneshot_twins(arms, schedules)
    for label in [k for k, ts in arms.items() if not len(ts)]:    # golden (under a schedule: schedule_arms)
        arms.pop(label)
    singles = [n for ts in arms.values() if len(ts) == 1 for n in ts.names]
    return arms, list(dict.fromkeys([*base.names, *singles])), schedules


def _with_oneshot_twins(arms: dict, schedules: dict) -> None:
    """Every toggle arm given only under a schedule gains its one-shot arm (same prompts,
    one more forward each): "under S" is then said only when S changes the effect -- a bug
    that acts without any schedule is the toggle's finding, not the schedule's."""
    oneshot = {frozenset(ts.names) for label, ts in arms.items() if schedules[label] == ONESHOT}
    for label, ts in list(arms.items()):
        if len(ts) and schedules[label] != ONESHOT and frozenset(ts.names) not in oneshot:
            twin = label.rsplit("@", 1)[0]
            arms[twin], schedules[twin] = ts, ONESHOT
            oneshot.add(frozenset(ts.names))


def base_toggles(settings: ABSettings, model: str = "v4") -> frozenset:
    """The --base arm's toggles (its base + t arms give t an added_to_base effect)."""
    d = settings.design
    default = Schedule.parse(d.schedule or "oneshot")
    return frozenset(K.ToggleSet.parse(d.base, model).names) | schedule_factors(default)


def schedule_factor(s: Schedule) -> str:
    """The schedule as an attribution factor: an arm under it differs from one-shot by it."""
    return f"{SCHEDULE_FACTOR}{s}"


def schedule_factors(s: Schedule) -> frozenset:
    return frozenset() if s == ONESHOT else frozenset({schedule_factor(s)})


def toggle_arms(label_sets: dict, cd=torch.float64, schedules: dict | None = None) -> list[LockstepArm]:
    """One arm per label; an arm under a schedule counts the schedule among its factors."""
    out = []
    for label, ts in label_sets.items():
        s = (schedules or {}).get(label, ONESHOT)
        out.append(LockstepArm(label, ts.numerics("reference", compute_dtype=cd),
                               frozenset(ts.names) | schedule_factors(s), schedule=s))
    return out


def schedule_arms(schedules: dict, cd=torch.float64) -> list[LockstepArm]:
    """Per schedule in use: golden under it as a floor (`floor:schedule@S`, what the reference
    itself does under that schedule) and as a candidate arm (`golden@S`, factor `@S`), so an
    arm's effect under S is attributed against golden under S."""
    out = []
    for s in dict.fromkeys(v for v in schedules.values() if v != ONESHOT):
        out += [LockstepArm(f"{FLOOR_SCHEDULE}@{s}", Numerics("reference", cd), frozenset(),
                            role="floor", schedule=s),
                LockstepArm(f"{GOLDEN}@{s}", Numerics("reference", cd), frozenset({schedule_factor(s)}),
                            schedule=s)]
    return out


def golden_arm(cd=torch.float64) -> LockstepArm:
    return LockstepArm(GOLDEN, Numerics("reference", cd), frozenset(), role="golden")


def weight_arms(variants: dict | None, cd=torch.float64) -> list[LockstepArm]:
    """Golden numerics on each other checkpoint: arm `weights:<name>`, its own factor."""
    return [LockstepArm(WEIGHTS_PREFIX + n, Numerics("reference", cd), frozenset({WEIGHTS_PREFIX + n}),
                        weights=w) for n, w in (variants or {}).items()]


def floor_arms(cd=torch.float64) -> list[LockstepArm]:
    """The three noise floors (see the module docstring); `cd` is golden's accumulation
    dtype (the tie-order floor uses it too, so it measures only the tie order)."""
    ties = Numerics("reference", cd).with_kernels(
        "tie-order", index_topk=lambda golden, scores, k: topk_highest_index_ties(scores, k))
    return [LockstepArm(FLOOR, Numerics("exact"), frozenset(), role="floor"),
            LockstepArm(FLOOR_ORDER, Numerics("reference", torch.float32), frozenset(), role="floor"),
            LockstepArm(FLOOR_TIES, ties, frozenset(), role="floor")]


def vs_pairs(vs: str | None, label_sets) -> dict[str, str]:
    """Arms compared directly with the --vs arm: those that contain all its toggles."""
    if not vs or vs == GOLDEN:
        return {}
    if vs not in label_sets:
        raise ValueError(f"--vs {vs!r} is not one of the arms: {', '.join(label_sets)}")
    ref = frozenset(label_sets[vs].names)
    return {a: vs for a, ts in label_sets.items() if a != vs and frozenset(ts.names) > ref}


def top_toggles(toggles, table, m):
    """The m (at most 6) toggles with the largest single or leave-one-out effect."""
    if m <= 0:
        return []
    eff = {}
    full = frozenset(toggles)
    for t in toggles:
        vals = []
        if frozenset({t}) in table:
            vals.append(abs(table[frozenset({t})].mean()))
        if full in table and full - {t} in table:
            vals.append(abs(table[full].mean() - table[full - {t}].mean()))
        if vals:
            eff[t] = max(vals)
    return sorted(eff, key=lambda t: -eff[t])[: min(m, 6)]


def factorial_arms(top: list[str], table: dict, sets: dict) -> dict:
    """Label -> ToggleSet of every combination of 2+ of `top` not run yet."""
    new = {}
    for r in range(2, len(top) + 1):
        for combo in itertools.combinations(top, r):
            s = frozenset(combo)
            if s not in table and s not in {frozenset(v) for v in sets.values()}:
                ts = K.ToggleSet(combo)
                new[str(ts)] = ts
    return new
