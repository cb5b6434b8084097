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
expert, and totals. "Changed": not bit-identical, or with a tolerance, rel L2 > tolerance.

The report folder and the terminal summary are fidelity.weights.diff_report's."""
from __future__ import annotations

import math
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

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


def changed_criterion(tolerance) -> str:
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
        where.append(f"layer{'s' if len(ls) > 1 else ''} {id_ranges(ls)}")
    return (f"The checkpoints differ: {c} of {n} tensors changed ({changed_criterion(tolerance)}) in "
            f"{' and '.join(where)}; largest rel L2 {tot['max_rel_l2']:.3g} "
            f"({tot['max_rel_l2_tensor']})")


def id_ranges(ids: list[int]) -> str:
    """Sorted ids as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
