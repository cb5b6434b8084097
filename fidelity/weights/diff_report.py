"""The weights-diff report: the folder (tables, manifest, the per-layer plot, the page)
under <out>/weights-diff/<run_id>/ and the few lines printed on the terminal, from a
fidelity.weights.diff DiffResult."""
from __future__ import annotations

import time
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.transforms as mtransforms
import numpy as np
import pandas as pd

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from .diff import DiffResult, changed_criterion, id_ranges


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def plot_layers(layers: pd.DataFrame, tolerance):
    """Max rel L2 per layer, log scale; identical layers (0) as grey marks on the bottom."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = layers.layer.to_numpy(dtype=float)
    y = layers.max_rel_l2.to_numpy(dtype=float)
    y = np.where(np.isfinite(y), y, np.nan)
    pos = y > 0
    lo = float(np.nanmin(y[pos])) / 10 if pos.any() else 1e-12
    hi = float(np.nanmax(y[pos])) * 3 if pos.any() else 1.0
    if tolerance:
        lo, hi = min(lo, tolerance / 10), max(hi, tolerance * 3)
    if pos.any():
        ax.plot(x[pos], y[pos], marker="o", ms=4, lw=1.3, color="C3", label="max rel L2 (> 0)")
    zero = y == 0
    if zero.any():
        ax.scatter(x[zero], np.full(zero.sum(), 0.0), marker="x", color="0.5", clip_on=False,
                   transform=mtransforms.blended_transform_factory(ax.transData, ax.transAxes),
                   label="identical (rel L2 0, off the log axis)", zorder=3)
    if tolerance:
        ax.axhline(tolerance, color="0.4", ls="--", lw=1, label=f"tolerance {tolerance:g}")
    if not pos.any():
        ax.text(0.5, 0.5, "no compared layer differs", transform=ax.transAxes, ha="center",
                color="0.4")
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.set_xlim(x.min() - 0.5, x.max() + 0.5)     # the crosses are not autoscaled
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("max rel L2 over the layer's tensors (B vs A)")
    ax.grid(alpha=.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _inputs_table(res: DiffResult) -> pd.DataFrame:
    m, tot = res.manifest, res.totals
    rows = []
    for side in ("a", "b"):
        s = m[side]
        rows.append({"checkpoint": side.upper(), "path": s["path"],
                     "layout": s["layout"] + (f" ({s['float_dtype']})" if s["float_dtype"] else ""),
                     "shards": s["shards"], "compared bytes": tot[f"bytes_{side}"],
                     "compared size": _size(tot[f"bytes_{side}"]),
                     "checkpoint size": _size(tot[f"checkpoint_bytes_{side}"])})
    return pd.DataFrame(rows)


def _top_changed(t: pd.DataFrame, n: int = 25) -> pd.DataFrame:
    c = t[t.changed].copy()
    c["_k"] = c.rel_l2.fillna(float("inf"))
    return c.sort_values("_k", ascending=False).head(n)[
        ["tensor", "rel_l2", "max_abs_diff", "dtype_a", "dtype_b", "bytes_a", "bytes_b"]]


def _expert_lines(layers: pd.DataFrame) -> list[str]:
    return [f"- layer {int(r.layer)}: experts {r.changed_experts.replace(' ', ', ')}"
            for r in layers.itertuples() if r.n_changed_experts]


def _compared(res: DiffResult) -> str:
    m, tot = res.manifest, res.totals
    sel = ("all layers" if len(m["settings"]["layers"]) == m["config"]["n_layers"]
           else f"layers {id_ranges(m['settings']['layers'])}" if m["settings"]["layers"] else "no layers")
    sel += " and the globals" if m["settings"]["globals"] else " (globals not compared)"
    return (f"A `{m['a']['path']}` ({m['a']['layout']}) vs B `{m['b']['path']}` ({m['b']['layout']}), "
            f"model config `{m['config_hash']}`: {sel}, {tot['tensors']} tensors on their dequantised "
            f"values (fp64 rel L2 = ‖A−B‖/‖A‖); changed = {changed_criterion(m['settings']['tolerance'])}. "
            f"{tot['seconds']:.1f} s.")


def _totals(res: DiffResult) -> str:
    tot = res.totals
    return "\n".join([
        f"- tensors compared: {tot['tensors']}; changed: {tot['changed']}; bit-identical: {tot['identical']}",
        f"- changed layers: {id_ranges(tot['changed_layers']) or 'none'}; changed globals: "
        f"{tot['globals_changed'] if tot['globals_compared'] else 'not compared'}",
        f"- changed routed experts: {tot['changed_experts']}",
        f"- on-disk bytes of the compared tensors: A {tot['bytes_a']} ({_size(tot['bytes_a'])}), "
        f"B {tot['bytes_b']} ({_size(tot['bytes_b'])})"])


def build_page(res: DiffResult) -> Page:
    top = _top_changed(res.tensors) if res.totals["changed"] else pd.DataFrame()
    sections = [
        Section("Checkpoints", "", [Table(_inputs_table(res), fold=False)]),
        Section("Totals", _totals(res)),
        Section("Changed routed experts per layer", "\n".join(_expert_lines(res.layers)) or "None."),
        Section("Layers", "", [Table(res.layers, summary=f"{len(res.layers)} layers")]),
        Section("Tensor families", "", [Table(res.families)]),
    ]
    nxt = []
    if res.totals["changed"]:
        m = res.manifest
        nxt = [f"fidelity ab --weights a={m['a']['path']} --weights b={m['b']['path']}   "
               "# what the changed weights do to drift, KLD and the verdict's signals"]
    return Page("dsv4-fidelity weights-diff", _compared(res), [res.verdict + "."], ["max_rel_l2_per_layer"],
                Table(top, caption="Largest changes (every tensor: tensors.csv.gz).", fold=False)
                if len(top) else None, nxt, sections,
                {k: v for k, v in res.manifest.items() if k != "config"})


def write_report(res: DiffResult, out_dir="reports", run_id: str | None = None) -> Path:
    """<out_dir>/weights-diff/<run_id>/ (+ a `latest` link there)."""
    run_id = run_id or time.strftime("weights-diff-%Y%m%d-%H%M%S")
    w = ReportWriter(Path(out_dir) / "weights-diff", run_id)
    try:
        w.table("tensors", res.tensors, gzip=True)
        w.table("families", res.families)
        w.table("layers", res.layers)
        w.table("experts", res.experts)
        w.json("manifest", {**res.manifest, "run_id": run_id, "verdict": res.verdict,
                            "totals": res.totals})
        tol = res.manifest["settings"]["tolerance"]
        if len(res.layers):
            w.figure(plot_layers(res.layers, tol), "max_rel_l2_per_layer", "Max rel L2 per layer",
                     "Largest ‖A−B‖/‖A‖ (fp64, dequantised values) over each layer's tensors, log "
                     "scale; grey crosses on the axis: layers whose tensors are all identical "
                     "(rel L2 0).")
        w.page(build_page(res))
        plt.close("all")
        return w.commit()
    except BaseException:
        w.abort()
        raise


def summary_text(res: DiffResult, path: Path | None = None) -> str:
    """The few lines printed on the terminal."""
    m, tot = res.manifest, res.totals
    L = [f"A: {m['a']['path']} ({m['a']['layout']}, {_size(tot['bytes_a'])} compared)",
         f"B: {m['b']['path']} ({m['b']['layout']}, {_size(tot['bytes_b'])} compared)",
         f"{res.verdict}."]
    for r in res.layers[res.layers.changed > 0].itertuples():
        ex = f"; experts {r.changed_experts.replace(' ', ',')}" if r.n_changed_experts else ""
        L.append(f"  layer {r.layer}: {r.changed}/{r.tensors} tensors changed, max rel L2 "
                 f"{r.max_rel_l2:.3g} ({r.max_rel_l2_tensor}){ex}")
    if tot["globals_changed"]:
        g = res.tensors[res.tensors.layer.isna() & res.tensors.changed]
        L.append(f"  globals: {', '.join(g.tensor)}")
    if path is not None:
        L.append(f"report: {path}")
    return "\n".join(L)
