"""Arms and prompts shared by the distributed tests' single-process and pipelined runs."""
import pandas as pd
import torch

from fidelity.ab.lockstep import LockstepArm, Prompt
from kernel_toggles import ToggleSet
from reference_model import Numerics


def arms():
    return [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("engine", ToggleSet.parse("engine").numerics(), frozenset({"engine"})),
            LockstepArm("bug", ToggleSet.parse("engine,routed_scaling_double").numerics(), frozenset({"b"}))]


def prompts():
    g = torch.Generator().manual_seed(7)
    return [Prompt(f"p{j}", torch.randint(2, 500, (n,), generator=g), needle_tokens=(5, 6) if j else ())
            for j, n in enumerate((90, 41))]


def tables(res) -> dict:
    return {k: pd.DataFrame(getattr(res, k)) for k in ("drift", "kld", "pairs", "pair_kld", "needle", "events")}
