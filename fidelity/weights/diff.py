"""`fidelity weights-diff A B`: the static half of "is it the checkpoint or the engine?".

Two checkpoints of one architecture are compared tensor by tensor on their DEQUANTISED
values (what the forward consumes: FP8 / FP4 -> bf16, NVFP4 experts -> fp32, dense
conversions as stored), so a native FP8/FP4 release, its NVFP4-experts re-quantisation and a
bf16 dequantised conversion compare as equal wherever they hold the same numbers.

Streaming: each side is a reference_model StreamingWeights, asked for one layer at a time
(A's layer i and B's layer i, released before layer i+1; globals last, after the layers),
and every comparison runs in fp64 chunks of `CHUNK` elements, so memory stays at one
dequantised layer per checkpoint plus a few MB of temporaries.

Per tensor (native name): rel L2 = ||a-b|| / ||a|| (fp64), max |a-b|, bit-identical
(the dequantised values: equal fp64 bit patterns, which tells -0 from 0), on-disk bytes and
dtypes of its entries in each checkpoint (weight + scale, NVFP4's four entries, ...).
Aggregates per tensor family (layer and expert indices stripped), per layer, per routed
expert, and totals. "Changed": not bit-identical, or with a tolerance, rel L2 > tolerance."""
from __future__ import annotations

import math
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.transforms as mtransforms
import numpy as np
import pandas as pd
import torch

from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter
from reference_model.checkpoint import CheckpointError, StreamingWeights, scan_checkpoint
from reference_model.checkpoint_format import disk_entries
from reference_model.config import ConfigError
from reference_model.specs import global_specs, layer_specs

CHUNK = 1 << 22          # elements per fp64 comparison step (32 MB per operand)
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


class WeightsDiffError(ValueError):
    """Bad input: a missing / invalid checkpoint, differing configs, bad layer selection.
    `problems` lists every one of them, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ---- comparison of one tensor ---------------------------------------------------------
@dataclass
class TensorDiff:
    rel_l2: float
    max_abs: float
    identical: bool
    norm_a: float
    norm_diff: float


def compare_tensors(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK) -> TensorDiff:
    """fp64 rel L2 ||a-b||/||a|| (0 when both are zero, inf when only a is), max |a-b| and
    bit-identity of the values, in chunks so no full-size fp64 copy is ever made."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    x_all, y_all = a.reshape(-1), b.reshape(-1)
    sa = sd = 0.0
    mx, identical, nan = 0.0, True, False
    for s in range(0, x_all.numel(), chunk):
        x = x_all[s:s + chunk].to(torch.float64)
        y = y_all[s:s + chunk].to(torch.float64)
        if identical and not torch.equal(x.view(torch.int64), y.view(torch.int64)):
            identical = False
        if identical:
            sa += float(torch.dot(x, x))
            continue
        d = x - y
        sa += float(torch.dot(x, x))
        sd += float(torch.dot(d, d))
        m = float(d.abs().max())
        if m != m:
            nan = True
        else:
            mx = max(mx, m)
    if identical:
        return TensorDiff(0.0, 0.0, True, math.sqrt(sa), 0.0)
    if nan:
        return TensorDiff(float("nan"), float("nan"), False, math.sqrt(sa), float("nan"))
    na, nd = math.sqrt(sa), math.sqrt(sd)
    rel = nd / na if na > 0 else (0.0 if nd == 0 else float("inf"))
    return TensorDiff(rel, mx, False, na, nd)


# ---- names ----------------------------------------------------------------------------
def family(name: str) -> str:
    """`layers.7.ffn.experts.12.w1.weight` -> `ffn.experts.w1.weight`; globals unchanged."""
    return re.sub(r"\.experts\.\d+\.", ".experts.", re.sub(r"^layers\.\d+\.", "", name))


def parse_layers(text: str | None, n_layers: int) -> tuple[list[int], bool]:
    """`--layers` -> (layer ids, compare globals). None: every layer and the globals;
    otherwise comma-separated ids, ranges `a-b` and the word `globals`."""
    if text is None:
        return list(range(n_layers)), True
    layers, glob, bad = [], False, []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok.lower() == "globals":
            glob = True
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", tok)
        if not m:
            bad.append(f"--layers: {tok!r} is not a layer id, a range a-b or 'globals'")
            continue
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo or hi >= n_layers:
            bad.append(f"--layers: {tok} is outside the model's layers 0..{n_layers - 1}")
            continue
        layers += range(lo, hi + 1)
    if not layers and not glob and not bad:
        bad.append("--layers selects nothing")
    if bad:
        raise WeightsDiffError(bad)
    return sorted(set(layers)), glob


# ---- the run --------------------------------------------------------------------------
@dataclass
class DiffResult:
    tensors: pd.DataFrame
    families: pd.DataFrame
    layers: pd.DataFrame
    experts: pd.DataFrame
    totals: dict
    verdict: str
    manifest: dict = field(default_factory=dict)


def _scan(label: str, path):
    if not Path(path).exists():
        raise WeightsDiffError([f"checkpoint {label} ({path}): no such file or directory"])
    try:
        return scan_checkpoint(path)
    except CheckpointError as e:
        raise WeightsDiffError([f"checkpoint {label} ({path}): {p}" for p in e.problems]) from None
    except ConfigError as e:
        raise WeightsDiffError([f"checkpoint {label} ({path}): config: {e}"]) from None


def config_differences(cfg_a, cfg_b) -> list[str]:
    """Every config field (except the name) whose value differs, with both values."""
    a, b = cfg_a.to_dict(), cfg_b.to_dict()
    return [f"config mismatch: {k}: A has {a[k]!r}, B has {b.get(k)!r}"
            for k in a if k != "name" and a[k] != b.get(k)]


def _disk(info, spec) -> tuple[int, str]:
    """Bytes and dtypes ('+'-joined, weight first) of the entries storing one tensor."""
    hs = [info.tensors[e.name] for e in disk_entries(spec, info.layout, info.float_dtype)]
    return sum(h.nbytes for h in hs), "+".join(h.dtype for h in hs)


@dataclass(frozen=True)
class _Pair:
    """The two scanned checkpoints (one architecture) and what is compared."""
    path_a: object
    path_b: object
    info_a: object                # reference_model CheckpointInfo of A
    info_b: object
    layer_ids: list
    with_globals: bool
    tolerance: float | None

    @property
    def cfg(self):
        return self.info_a.cfg


def _rows(specs, wa: dict, wb: dict, strip: str, layer, pair: _Pair) -> list[dict]:
    out, tolerance = [], pair.tolerance
    for s in specs:
        k = s.name[len(strip):]
        d = compare_tensors(wa[k], wb[k])
        changed = (not d.identical) and (tolerance is None or not (d.rel_l2 <= tolerance))
        m = _EXPERT.match(s.name)
        ba, da = _disk(pair.info_a, s)
        bb, db = _disk(pair.info_b, s)
        out.append({"tensor": s.name, "family": family(s.name), "layer": layer,
                    "expert": int(m[2]) if m else None, "shape": "x".join(map(str, s.shape)),
                    "numel": s.numel, "rel_l2": d.rel_l2, "max_abs_diff": d.max_abs,
                    "identical": d.identical, "changed": changed, "norm_a": d.norm_a,
                    "bytes_a": ba, "bytes_b": bb, "dtype_a": da, "dtype_b": db,
                    "mem_dtype_a": str(wa[k].dtype).replace("torch.", ""),
                    "mem_dtype_b": str(wb[k].dtype).replace("torch.", "")})
    return out


def _max_or_zero(s: pd.Series) -> float:
    """Max that propagates NaN (a NaN tensor must not look unchanged)."""
    if s.isna().any():
        return float("nan")
    return float(s.max()) if len(s) else 0.0


def _argmax_name(g: pd.DataFrame) -> str:
    if not len(g) or not (g.rel_l2.fillna(float("inf")) > 0).any():
        return ""
    return str(g.loc[g.rel_l2.fillna(float("inf")).idxmax(), "tensor"])


def diff_checkpoints(path_a, path_b, layers: str | None = None, tolerance: float | None = None,
                     progress=None) -> DiffResult:
    """Compare two checkpoints of one architecture (see module doc). `layers`: the
    `--layers` text (None = all layers and the globals). `progress`: fidelity.progress
    Progress or None. Raises WeightsDiffError on bad input."""
    if tolerance is not None and not (tolerance >= 0):
        raise WeightsDiffError([f"--tolerance must be >= 0, got {tolerance}"])
    pair = _open_pair(path_a, path_b, layers, tolerance)
    t0 = time.monotonic()
    rows = _compare(pair, progress)
    return _assemble(rows, pair, time.monotonic() - t0)


def _open_pair(path_a, path_b, layers: str | None, tolerance) -> _Pair:
    """Scan both headers (every problem of both reported at once) and check that they are
    one architecture."""
    problems = []
    infos = {}
    for label, p in (("A", path_a), ("B", path_b)):
        try:
            infos[label] = _scan(label, p)
        except WeightsDiffError as e:
            problems += e.problems
    if problems:
        raise WeightsDiffError(problems)
    ia, ib = infos["A"], infos["B"]
    mism = config_differences(ia.cfg, ib.cfg)
    if mism:
        raise WeightsDiffError([f"A ({path_a}) and B ({path_b}) are different architectures:"] + mism)
    layer_ids, with_globals = parse_layers(layers, ia.cfg.n_layers)
    return _Pair(path_a, path_b, ia, ib, layer_ids, with_globals, tolerance)


def _compare(pair: _Pair, progress) -> list[dict]:
    """One row per compared tensor, streaming one layer of each checkpoint at a time."""
    cfg, layer_ids = pair.cfg, pair.layer_ids
    A, B = StreamingWeights(pair.info_a), StreamingWeights(pair.info_b)
    rows: list[dict] = []
    quiet = lambda n=1, note="": None    # noqa: E731
    task = (progress.task("comparing layers", len(layer_ids)) if progress is not None and layer_ids
            else nullcontext(quiet))
    try:
        with task as adv:
            for i in layer_ids:
                la, lb = A.layer_weights(i), B.layer_weights(i)
                r = _rows(layer_specs(cfg, i), la, lb, f"layers.{i}.", i, pair)
                del la, lb
                A.release(), B.release()
                rows += r
                adv(1, f"layer {i}: {sum(x['changed'] for x in r)} changed")
        if pair.with_globals:            # last: not resident while the layers stream
            rows = _rows(global_specs(cfg), A.global_weights(), B.global_weights(), "", None,
                         pair) + rows
    except CheckpointError as e:         # bad data the headers could not show
        raise WeightsDiffError(list(e.problems)) from None
    finally:
        A.release(), B.release()
    return rows


def _assemble(rows: list[dict], pair: _Pair, elapsed: float) -> DiffResult:
    t = pd.DataFrame(rows)
    t["layer"] = t["layer"].astype("Int64")
    t["expert"] = t["expert"].astype("Int64")
    families = _families(t)
    experts = _experts(t)
    layers = _layers(t, experts, pair)
    ia, ib, cfg = pair.info_a, pair.info_b, pair.cfg
    g = t[t.layer.isna()]
    totals = {
        "tensors": len(t), "changed": int(t.changed.sum()), "identical": int(t.identical.sum()),
        "changed_layers": [int(x) for x in layers[layers.changed > 0].layer],
        "globals_compared": pair.with_globals, "globals_changed": int(g.changed.sum()),
        "max_rel_l2": _max_or_zero(t.rel_l2), "max_rel_l2_tensor": _argmax_name(t),
        "bytes_a": int(t.bytes_a.sum()), "bytes_b": int(t.bytes_b.sum()),
        "checkpoint_bytes_a": int(ia.total_bytes), "checkpoint_bytes_b": int(ib.total_bytes),
        "changed_experts": int(experts.changed.sum()),
        "seconds": round(elapsed, 2),
    }
    verdict = _verdict(totals, pair.tolerance, layers)
    manifest = {
        "a": {"path": str(pair.path_a), "layout": ia.layout, "float_dtype": ia.float_dtype,
              "shards": len(ia.shards), "notes": ia.notes},
        "b": {"path": str(pair.path_b), "layout": ib.layout, "float_dtype": ib.float_dtype,
              "shards": len(ib.shards), "notes": ib.notes},
        "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
        "settings": {"layers": pair.layer_ids, "globals": pair.with_globals,
                     "tolerance": pair.tolerance},
    }
    return DiffResult(t, families, layers, experts, totals, verdict, manifest)


def _families(t: pd.DataFrame) -> pd.DataFrame:
    fam = []
    for name, g in t.groupby("family", sort=False):
        fam.append({"family": name, "tensors": len(g), "changed": int(g.changed.sum()),
                    "identical": int(g.identical.sum()), "max_rel_l2": _max_or_zero(g.rel_l2),
                    "max_rel_l2_tensor": _argmax_name(g), "max_abs_diff": _max_or_zero(g.max_abs_diff),
                    "bytes_a": int(g.bytes_a.sum()), "bytes_b": int(g.bytes_b.sum()),
                    "dtype_a": ", ".join(dict.fromkeys(g.dtype_a)),
                    "dtype_b": ", ".join(dict.fromkeys(g.dtype_b))})
    return pd.DataFrame(fam, columns=["family", "tensors", "changed", "identical", "max_rel_l2",
                                      "max_rel_l2_tensor", "max_abs_diff", "bytes_a", "bytes_b",
                                      "dtype_a", "dtype_b"])


def _experts(t: pd.DataFrame) -> pd.DataFrame:
    ex = t[t.expert.notna()]
    exp_rows = []
    for (layer, e), g in ex.groupby(["layer", "expert"], sort=True):
        row = {"layer": int(layer), "expert": int(e), "changed": bool(g.changed.any()),
               "identical": bool(g.identical.all()), "max_rel_l2": _max_or_zero(g.rel_l2)}
        for w in ("w1", "w2", "w3"):
            gw = g[g.tensor.str.endswith(f".{w}.weight")]
            row[f"{w}_rel_l2"] = float(gw.rel_l2.iloc[0]) if len(gw) else float("nan")
        exp_rows.append(row)
    return pd.DataFrame(exp_rows, columns=["layer", "expert", "changed", "identical", "max_rel_l2",
                                           "w1_rel_l2", "w2_rel_l2", "w3_rel_l2"])


def _layers(t: pd.DataFrame, experts: pd.DataFrame, pair: _Pair) -> pd.DataFrame:
    lay = []
    for i in pair.layer_ids:
        g = t[t.layer == i]
        ce = experts[(experts.layer == i) & experts.changed].expert.tolist()
        lay.append({"layer": i, "kind": pair.cfg.layer_kind(i), "tensors": len(g),
                    "changed": int(g.changed.sum()), "identical": int(g.identical.sum()),
                    "max_rel_l2": _max_or_zero(g.rel_l2), "max_rel_l2_tensor": _argmax_name(g),
                    "max_abs_diff": _max_or_zero(g.max_abs_diff),
                    "changed_experts": " ".join(map(str, ce)), "n_changed_experts": len(ce),
                    "bytes_a": int(g.bytes_a.sum()), "bytes_b": int(g.bytes_b.sum())})
    return pd.DataFrame(lay, columns=["layer", "kind", "tensors", "changed", "identical", "max_rel_l2",
                                      "max_rel_l2_tensor", "max_abs_diff", "changed_experts",
                                      "n_changed_experts", "bytes_a", "bytes_b"])


def _criterion(tolerance) -> str:
    return "any difference" if tolerance is None else f"rel L2 > {tolerance:g}"


def _verdict(tot: dict, tolerance, layers: pd.DataFrame) -> str:
    n, c = tot["tensors"], tot["changed"]
    if c == 0 and tot["identical"] == n:
        return (f"Same weights: all {n} compared tensors are bit-identical after dequantisation, so "
                "an output difference between engines on these checkpoints is not the checkpoint's")
    if c == 0:
        return (f"Same weights within tolerance: {n - tot['identical']} of {n} tensors differ, none by "
                f"more than rel L2 {tolerance:g} (largest {tot['max_rel_l2']:.3g}, "
                f"{tot['max_rel_l2_tensor']})")
    where = []
    if tot["globals_changed"]:
        where.append(f"{tot['globals_changed']} global")
    if tot["changed_layers"]:
        ls = tot["changed_layers"]
        where.append(f"layer{'s' if len(ls) > 1 else ''} {_ranges(ls)}")
    return (f"The checkpoints differ: {c} of {n} tensors changed ({_criterion(tolerance)}) in "
            f"{' and '.join(where)}; largest rel L2 {tot['max_rel_l2']:.3g} "
            f"({tot['max_rel_l2_tensor']})")


def _ranges(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


# ---- report ---------------------------------------------------------------------------
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
           else f"layers {_ranges(m['settings']['layers'])}" if m["settings"]["layers"] else "no layers")
    sel += " and the globals" if m["settings"]["globals"] else " (globals not compared)"
    return (f"A `{m['a']['path']}` ({m['a']['layout']}) vs B `{m['b']['path']}` ({m['b']['layout']}), "
            f"model config `{m['config_hash']}`: {sel}, {tot['tensors']} tensors on their dequantised "
            f"values (fp64 rel L2 = ‖A−B‖/‖A‖); changed = {_criterion(m['settings']['tolerance'])}. "
            f"{tot['seconds']:.1f} s.")


def _totals(res: DiffResult) -> str:
    tot = res.totals
    return "\n".join([
        f"- tensors compared: {tot['tensors']}; changed: {tot['changed']}; bit-identical: {tot['identical']}",
        f"- changed layers: {_ranges(tot['changed_layers']) or 'none'}; changed globals: "
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
