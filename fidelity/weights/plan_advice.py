"""What would fit when a plan does not: each remedy (fewer prompts per pass, a shorter
length, more devices, streamed weights, last-position logits) tried on its own by
re-planning the pass, and their combination when none fits alone."""
from __future__ import annotations

import math
from dataclasses import replace

from reference_model.config import ModelConfig

from .plan_devices import MemoryPlan, PassSpec, PlanNumerics, most_stages, plan_pass
from .plan_render import gib, size_text


def _largest_ok(lo: int, hi: int, f) -> int | None:
    """Largest v in [lo, hi] with f(v) (f monotone: true then false), or None."""
    if not f(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid - 1)
    return lo


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def advice(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, plan: MemoryPlan) -> list[str]:
    """One line per remedy, each tried on its own; if none fits alone, the combination."""
    def fits(**changes) -> bool:
        return plan_pass(cfg, replace(spec, **changes), nx).fits

    out: list[str] = []
    ok = [_advise_prompts(spec, fits, out), _advise_length(spec, fits, out),
          _advise_devices(cfg, spec, nx, fits, out)]
    if spec.weights_mode != "streamed":
        ok.append(fits(weights_mode="streamed"))
        out.append("streamed weights (--weights-mode streamed): " + (
            "fits" if ok[-1] else "not enough on its own"))
    head = max(plan.devices, key=lambda d: d.logits)              # the device running the head
    if spec.logits_mode == "all" and head.logits > 0:
        ok.append(fits(logits_mode="last"))
        out.append(f"logits of the last position only (--logits last; prefill logit chunks "
                   f"{gib(head.logits)} on {head.device}): "
                   + ("fits" if ok[-1] else "not enough on its own"))
    if not any(ok):
        out.append(_advise_together(spec, fits))
    return out


def _advise_prompts(spec: PassSpec, fits, out: list[str]) -> bool:
    prompts, arms = spec.prompts, spec.arms
    p = _largest_ok(1, prompts - 1, lambda v: fits(prompts=v)) if prompts > 1 else None
    if p:
        out.append(f"fewer prompts per pass: {p} prompt{_s(p)} x {arms} arm{_s(arms)} "
                   f"fit{'s' if p == 1 else ''} ({math.ceil(prompts / p)} passes for {prompts} "
                   "prompts)")
    elif prompts > 1:
        out.append("fewer prompts per pass: not enough (1 prompt per pass does not fit either)")
    return bool(p)


def _advise_length(spec: PassSpec, fits, out: list[str]) -> bool:
    length, prompts, arms = spec.length, spec.prompts, spec.arms
    n = _largest_ok(1, length - 1, lambda v: fits(length=v)) if length > 1 else None
    out.append(f"shorter length: up to {n} tokens fit with {prompts} prompts x {arms} arms"
               if n else f"shorter length: not enough (1 token does not fit with {prompts} "
                         f"prompts x {arms} arms)")
    return bool(n)


def _advise_devices(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, fits, out: list[str]) -> bool:
    """The smallest count of devices like the smallest one that fits (up to one per layer)."""
    kind = "cpu" if all(d == "cpu" for d in spec.devices) else "cuda"
    budget, have = min(spec.budgets), len(spec.devices)

    def devs(m: int) -> tuple[str, ...]:
        return ("cpu",) * m if kind == "cpu" else tuple(f"cuda:{j}" for j in range(m))

    cap = max(have, most_stages(cfg) if spec.pipeline else cfg.n_layers)
    more = _largest_ok(-cap, -(have + 1),
                       lambda v: fits(devices=devs(-v), budgets=(budget,) * -v)) \
        if cap > have else None                  # negated: the smallest count that fits
    if more is not None:
        out.append(f"more devices: {-more} x {size_text(budget)} fit (pipeline over {-more} devices)")
        return True
    w = plan_pass(cfg, replace(spec, devices=devs(cap), budgets=(budget,) * cap), nx).tightest
    out.append(f"more devices: not enough (with {cap} devices of {size_text(budget)}, "
               f"{w.device} still needs {gib(w.total)}: logits {gib(w.logits)}, streams "
               f"{gib(w.streams)}, workspace {gib(w.workspace)}, weights {gib(w.weights)})")
    return False


def _advise_together(spec: PassSpec, fits) -> str:
    both = dict(weights_mode="streamed", logits_mode="last")
    p = _largest_ok(1, spec.prompts, lambda v: fits(prompts=v, **both))
    if p == spec.prompts:
        return "together: streamed weights and last-position logits fit"
    if p:
        return f"together: streamed weights, last-position logits and {p} prompt{_s(p)} per pass fit"
    return ("together: streamed weights, last-position logits and 1 prompt per pass "
            "do not fit either")
