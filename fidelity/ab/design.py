"""`fidelity ab`'s settings and arms: golden, three noise floors (QAT: reference vs exact;
reduction order: fp32 vs fp64 accumulation; indexer tie order: top-k ties broken towards
the higher index), every optimization alone, the engine (all optimizations) and the
engine minus each; other checkpoints as `weights:<name>` arms; and the factorial stage
over the toggles with the largest effects, so Shapley values are exact there."""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

import torch

from kernel_toggles import arms as K
from reference_model import Numerics
from reference_model.numerics import topk_highest_index_ties

from .lockstep import DEFAULT_TAPS, LockstepArm

GOLDEN = "golden"
FLOOR = "floor:exact"              # reference vs exact: the QAT noise floor (verdict, attribution)
FLOOR_ORDER = "floor:fp32-accum"   # fp32 instead of fp64 accumulation: reduction-order noise
FLOOR_TIES = "floor:tie-order"     # indexer top-k ties broken the other way (torch.topk leaves it open)
FLOORS = (FLOOR, FLOOR_ORDER, FLOOR_TIES)
LONG_LENGTHS = (250, 511, 2047)    # --long: 2047 tokens = 511 CSA entries = 32x the tiny index_topk
WEIGHTS_PREFIX = "weights:"


@dataclass
class ABSettings:
    arms: list[str] | None = None          # extra/explicit arms (ToggleSet syntax); None = default design
    base: str = "engine"                   # arm whose leave-one-out is computed
    mode: str = "propagated"
    lengths: tuple[int, ...] = (250, 511)     # residues 2 and 3 mod 4: partial compressor groups
    prompts_per_length: int = 3
    decode_steps: int = 4
    seed: int = 0
    shapley_top: int = 3                   # factorial stage over this many toggles (0 = off)
    n_boot: int = 1000
    floor_k: float = 2.0
    vs: str | None = None                  # first divergence also against this arm
    taps: tuple[str, ...] = DEFAULT_TAPS
    keep: tuple[str, ...] = ()
    checkpoint: str = "embedded:tiny-random(seed=0)"
    prompts_file: str | None = None        # the user's prompts (JSONL) instead of the built-in ones
    devices: tuple[str, ...] = ("cpu",)    # layers placed across these (fidelity.devices)
    accumulate: str = "float64"            # golden's accumulation dtype (torch dtype name)
    activation_budget: int | None = None   # bytes of residual streams kept in memory per pass
    weights_variants: tuple = ()           # ((name, label), ...): other checkpoints as arms
    command_line: str = field(default_factory=lambda: " ".join(sys.argv))


def design(settings: ABSettings) -> tuple[dict[str, object], list[str]]:
    """Arm label -> ToggleSet, and the toggle names attribution ranges over."""
    base = K.ToggleSet.parse(settings.base)
    arms: dict[str, object] = {}
    if settings.arms is None:
        for s in K.one_at_a_time(base):
            arms[str(s)] = s
        arms[settings.base] = base
        named_base = K.is_engine_spelling(settings.base)
        for drop in base.names:               # ASCII names that parse back: engine-x
            arms[f"{settings.base}-{drop}" if named_base else str(base.without(drop))] = base.without(drop)
    else:
        for text in settings.arms:
            ts = K.ToggleSet.parse(text)
            arms[text if text in ("engine",) or text.startswith("engine") else str(ts)] = ts
    arms.pop(GOLDEN, None)
    singles = [n for ts in arms.values() if len(ts) == 1 for n in ts.names]
    return arms, list(dict.fromkeys([*base.names, *singles]))


def base_toggles(settings: ABSettings) -> frozenset:
    """The --base arm's toggles (its base + t arms give t an added_to_base effect)."""
    return frozenset(K.ToggleSet.parse(settings.base).names)


def toggle_arms(label_sets: dict, cd=torch.float64) -> list[LockstepArm]:
    return [LockstepArm(label, ts.numerics("reference", compute_dtype=cd), frozenset(ts.names))
            for label, ts in label_sets.items()]


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


def vs_pairs(settings, label_sets) -> dict[str, str]:
    """Arms compared directly with the --vs arm: those that contain all its toggles."""
    if not settings.vs or settings.vs == GOLDEN:
        return {}
    if settings.vs not in label_sets:
        raise ValueError(f"--vs {settings.vs!r} is not one of the arms: {', '.join(label_sets)}")
    ref = frozenset(label_sets[settings.vs].names)
    return {a: settings.vs for a, ts in label_sets.items()
            if a != settings.vs and frozenset(ts.names) > ref}


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
