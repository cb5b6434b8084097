"""An engine's twin: the in-process arm its settings map to, so an engine is judged twice --
against the golden (differences by design, explained by the twin's toggles) and against
its twin (what no modelled arithmetic explains).

Also the floors of a comparison against any in-process arm: what is noise on *both* sides
of it. Against the golden those are `fidelity ab`'s three (QAT, reduction order, tie
order); against another arm they are that arm's own reduction-order and tie-order variants,
and its QAT floor only when it computes on the reference profile and stands in for the
golden (an in-process `--baseline`); against an engine's twin never (both sides compute
with the same QAT choice, so its gap would be a floor neither side has)."""
from __future__ import annotations

import torch

from reference_model import Numerics
from reference_model.numerics import topk_highest_index_ties

GOLDEN = "golden"
REDUCTION_FLOOR = "floor:{}-accum"          # the arm accumulating in the other float width
TIES_FLOOR = "floor:tie-order"              # indexer top-k ties broken towards the higher index
QAT_FLOOR_NAME = "floor:exact"               # the arm's toggles without the QAT simulation


def other_width(cd: torch.dtype) -> torch.dtype:
    """fp64 accumulation's reduction-order partner is fp32, and the other way round."""
    return torch.float32 if cd == torch.float64 else torch.float64


def _width(cd: torch.dtype) -> str:
    return str(cd).replace("torch.float", "fp")


def floor_numerics(spec: str, model: str = "v4", cd: torch.dtype = torch.float64,
                   qat: bool = True) -> list[tuple[str, Numerics]]:
    """(name, Numerics) of the floors of a comparison against the in-process arm `spec`
    computed with accumulation `cd`: its toggles in the other float width, its toggles with
    the other tie order, and (reference profile and `qat` only) its toggles on the exact
    profile. An engine against its twin passes qat=False: both sides compute with (or both
    without) the QAT simulation, so its gap is a floor neither side has."""
    from fidelity.design.arms import parse_arm, pinned_profile
    arm = parse_arm(spec, model)
    profile = pinned_profile(spec.partition("@")[0].strip())[0] or "reference"
    from kernel_toggles import ToggleSet
    ts = ToggleSet.parse(",".join(arm.toggles), model)
    ties = Numerics(profile, cd).with_kernels(
        "tie-order", index_topk=lambda golden, scores, k: topk_highest_index_ties(scores, k))
    out = []
    if profile == "reference" and qat:
        out.append((QAT_FLOOR_NAME, ts.numerics("exact", compute_dtype=cd)))
    out.append((REDUCTION_FLOOR.format(_width(other_width(cd))), ts.numerics(profile, compute_dtype=other_width(cd))))
    out.append((TIES_FLOOR, ts.numerics(profile, base=ties)))
    return out
