"""A memory plan as text: the run described, per-sequence sizes, one markdown row per
device in GiB, the verdict and the advice lines."""
from __future__ import annotations

from .plan_devices import MemoryPlan

GiB = 1 << 30


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def size_text(n: int) -> str:
    """A budget in both units: '89.41 GiB (96 GB)'."""
    return f"{n / GiB:.2f} GiB ({n / 1e9:g} GB)" if n % 10**6 == 0 else gib(n)


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def _layer_span(layers: list[int]) -> str:
    if not layers:
        return "-"
    return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def describe(plan: MemoryPlan) -> str:
    """One paragraph: the run being planned."""
    dt = plan.dtypes
    names = {1: "1 B", 2: "2 B", 4: "4 B", 8: "8 B"}
    return (f"{plan.model}: {plan.n_layers} layers, length {plan.length} tokens, "
            f"{plan.prompts} prompt{'s' if plan.prompts != 1 else ''} x {plan.arms} "
            f"arm{'s' if plan.arms != 1 else ''} = {plan.sequences} sequences per pass, "
            f"weights {plan.weights_mode}"
            + (f" (dequant {plan.dequant})" if plan.weights_mode == "resident-quantised" else "")
            + f", profile {plan.profile} (state kv {names.get(dt.kv, dt.kv)}, compressor "
            f"{names.get(dt.compressor, dt.compressor)}, indexer keys "
            f"{names.get(dt.index_keys, dt.index_keys)}, stream {names.get(dt.stream, dt.stream)}"
            f" per element), logits {plan.logits_mode}, layers balanced on weight bytes.")


def per_sequence_line(plan: MemoryPlan) -> str:
    ps = plan.per_sequence
    kinds = ", ".join(f"{k} {gib(v['bytes'])} ({v['layers']} layers)"
                      for k, v in ps["state_by_kind"].items())
    return (f"Per sequence of {plan.length} tokens: state {gib(ps['state'])} ({kinds}); "
            f"residual stream {gib(ps['stream'])}; logits {gib(ps['logits'])}.")


def host_mapped_line(plan: MemoryPlan) -> str:
    return (f"Host, memory-mapped: Engram tables {gib(plan.totals['host_mapped'])}, read from "
            "the checkpoint files in place (only the rows each token gathers move to its "
            "layer's device); not counted on any device.")


def render(plan: MemoryPlan, title: str | None = None, full: bool = True) -> str:
    """Markdown: the run and per-sequence sizes (full), one row per device (GiB), the
    verdict and what would fit."""
    L = []
    if title:
        L += [title, ""]
    if full:
        L += [describe(plan), "", per_sequence_line(plan), ""]
        if plan.totals.get("host_mapped"):
            L += [host_mapped_line(plan), ""]
    L += ["| device | layers | globals | weights | dequant | state | streams | logits | "
          "workspace | total | budget | free |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in plan.devices:
        g = ", ".join(n.split(".")[0] if n.endswith(".weight") else n for n in d.globals
                      if n in ("embed.weight", "head.weight")) or "-"
        free = _g(d.free) if d.fits else f"**{_g(d.free)}**"
        L.append(f"| {d.device} | {_layer_span(d.layers)} | {g} | {_g(d.weights)} | "
                 f"{_g(d.dequant)} | {_g(d.state)} | {_g(d.streams)} | {_g(d.logits)} | "
                 f"{_g(d.workspace)} | {_g(d.total)} | {_g(d.budget)} | {free} |")
    budgets = sorted({d.budget for d in plan.devices})
    if full:
        L += ["", f"(GiB = 2^30 bytes; budget {', '.join(size_text(b) for b in budgets)} per device)"]
    L.append("")
    L.append(verdict(plan))
    L += [f"  - {a}" for a in plan.advice]
    return "\n".join(L)


def verdict(plan: MemoryPlan) -> str:
    t = plan.tightest
    if plan.fits:
        return (f"FITS: tightest device {t.device} uses {gib(t.total)} of {gib(t.budget)} "
                f"({gib(t.free)} free).")
    over = [d for d in plan.devices if not d.fits]
    worst = ", ".join(f"{d.device} needs {gib(d.total)} of {gib(d.budget)} (over by "
                      f"{gib(-d.free)})" for d in over)
    return f"DOES NOT FIT: {worst}. What would fit:"
