"""From tidy lockstep tables to answers: drift as a multiple of the noise floor, the first
divergent layer of each arm, per-prompt outcomes for attribution, and the verdict."""
from __future__ import annotations

import numpy as np
import pandas as pd

# Order of the taps inside one layer, as the forward produces them.
TAP_ORDER = ("hc_attn.comb", "attn.kv", "attn.index.topk", "attn.out", "hc_ffn.comb",
             "ffn.router.experts", "ffn.out", "out")
TENSOR_TAPS = ("hc_attn.comb", "attn.kv", "attn.out", "hc_ffn.comb", "ffn.out", "out")
KEYS = ["prompt", "phase", "step", "layer", "tap", "bucket"]


def with_floor_multiple(drift: pd.DataFrame, floor_arm: str) -> pd.DataFrame:
    """Adds `x_floor` = rel_l2 / floor arm's rel_l2 on the same prompt/phase/step/layer/tap/bucket."""
    if drift.empty or "rel_l2" not in drift:
        return drift.assign(x_floor=np.nan)
    fl = drift[drift.arm == floor_arm][KEYS + ["rel_l2"]].rename(columns={"rel_l2": "floor_rel_l2"})
    out = drift.merge(fl, on=KEYS, how="left")
    out["x_floor"] = out["rel_l2"] / out["floor_rel_l2"].replace(0, np.nan)
    return out


def layer_profile(drift: pd.DataFrame, tap: str = "out", phase: str = "prefill") -> pd.DataFrame:
    """Mean rel_l2 per arm and layer over prompts (bucket 'all')."""
    d = drift[(drift.tap == tap) & (drift.phase == phase) & (drift.bucket == "all")]
    return d.groupby(["arm", "layer"], as_index=False)["rel_l2"].mean()


def first_divergence(drift: pd.DataFrame, arm: str, reference_arm: str, k: float = 2.0,
                     phase: str = "prefill") -> dict | None:
    """First (layer, tap), in forward order, where the arm's mean rel_l2 exceeds k × the
    reference arm's (the noise floor, or e.g. the engine arm for engine+bug). A
    non-finite value diverges by definition."""
    d = drift[(drift.phase == phase) & (drift.bucket == "all") & drift.tap.isin(TENSOR_TAPS)]
    a = d[d.arm == arm].groupby(["layer", "tap"])["rel_l2"].mean()
    r = d[d.arm == reference_arm].groupby(["layer", "tap"])["rel_l2"].mean()
    order = sorted(a.index, key=lambda lt: (lt[0], TAP_ORDER.index(lt[1])))
    for lt in order:
        va, vr = float(a[lt]), float(r.get(lt, np.nan))
        if not np.isfinite(va) or (np.isfinite(vr) and va > k * max(vr, 1e-12)):
            return {"arm": arm, "layer": int(lt[0]), "tap": lt[1], "rel_l2": va,
                    "reference_rel_l2": vr, "ratio": va / max(vr, 1e-12) if np.isfinite(va) else np.inf}
    return None


def prompt_outcomes(kld: pd.DataFrame, group: str | None = None, phase: str = "prefill") -> pd.DataFrame:
    """Outcome per (arm, prompt): mean final-logit KLD over positions (optionally one group)."""
    d = kld[kld.phase == phase]
    if group is not None:
        d = d[d.group == group]
    return d.groupby(["arm", "prompt"], as_index=False)["kld"].mean()


def outcome_matrix(outcomes: pd.DataFrame, arms_to_sets: dict[str, frozenset],
                   golden: str) -> dict[frozenset, np.ndarray]:
    """{toggle subset: per-prompt outcome array} for attribution; golden's outcome is 0."""
    prompts = sorted(outcomes.prompt.unique())
    table = {frozenset(): np.zeros(len(prompts))}
    for arm, s in arms_to_sets.items():
        if arm == golden:
            continue
        v = outcomes[outcomes.arm == arm].set_index("prompt")["kld"].reindex(prompts)
        if v.notna().all():
            table[frozenset(s)] = v.to_numpy(dtype=float)
    return table


def verdict(attr: pd.DataFrame, floor_hi: float, floor_name: str = "noise floor") -> dict:
    """Name a culprit only when its attribution interval lies wholly above the floor."""
    if attr.empty:
        return {"culprit": None, "sentence": "No attribution was computed (need at least one "
                                             "toggle arm besides golden)."}
    method = next(m for m in ("shapley", "one_at_a_time", "leave_one_out") if m in set(attr.method))
    a = attr[attr.method == method].sort_values("value", ascending=False)
    top = a.iloc[0]
    clears = a[a.lo > floor_hi]
    if clears.empty:
        return {"culprit": None, "method": method, "sentence":
                f"No toggle stands out: no {method.replace('_', '-')} interval clears the "
                f"{floor_name} ({floor_hi:.3g} mean KLD); largest is {top.toggle} "
                f"({top.value:.3g} [{top.lo:.3g}, {top.hi:.3g}])."}
    c = clears.iloc[0]
    return {"culprit": c.toggle, "method": method, "value": float(c.value), "lo": float(c.lo),
            "hi": float(c.hi), "sentence":
            f"{c.toggle} breaks coherence: its {method.replace('_', '-')} share of the final-logit "
            f"KLD is {c.value:.3g} (95% CI [{c.lo:.3g}, {c.hi:.3g}]), "
            f"{c.value / max(floor_hi, 1e-12):.1f}× the {floor_name} ({floor_hi:.3g})."}
