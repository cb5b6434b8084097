"""Tensor replay on mlx-vlm: its tensors (harness.py `taps`: each layer's compressed entries,
indexer keys and picks, attention and MoE inputs and outputs, the stream after the block)
beside the golden's taps over the same ids computed in the same calls (one prompt, one token
per call, chunks), propagated and isolated, as llama.cpp's replay does (fidelity.llamacpp.replay,
whose comparisons and isolated blocks this reuses under llama.cpp's tensor names).

Its twin is the exact profile (mlx-vlm skips DeepSeek's QAT simulation); the twin's floor is
the exact profile in fp64 against fp32. What mlx-vlm adds beyond llama.cpp's replay:

  compressors  each layer's compressor and indexer compressor fed mlx-vlm's own attention
               input: which compressed entries depart, and whether they are exactly the entries
               whose preceding window was completed in an earlier call (the overlapping
               ratio-4 compressor reads the previous window: a state that must cross calls)
  causality    the route's logits at positions before a change of later tokens: a causal
               forward leaves them as they were"""
from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from reference_model import build_model
from reference_model.numerics import Numerics
from reference_model.taps import Taps

from fidelity.llamacpp import isolated as I
from fidelity.llamacpp import replay as R

from . import paths
from .convert import hisa_setting, hisa_toggle
from .harness import routes

TWIN = "exact"
# (golden tap under layers.{i}., mlx-vlm tensor before -{i}), in graph order
PAIRS = [("attn.compressed_kv", "kv_comp"), ("attn.index.keys", "lid_comp"), ("attn.out", "attn_out"),
         ("ffn.out", "ffn_out"), ("out", "l_out")]
CROSS_RATIO = 10.0       # entries across calls departing this much more than the others: the call boundary
COMPRESSORS = {"kv_comp": ("attn.compressed_kv", "the attention's compressor"),
               "lid_comp": ("attn.index.keys", "the indexer's compressor")}


def hisa_of(model_dir: Path, index_block: int | None = None) -> str:
    """The hisa toggle as mlx-vlm runs `model_dir` ('' when off; convert.hisa_setting)."""
    return hisa_toggle(hisa_setting(model_dir, index_block))


def replay_arms(hisa: str = "") -> dict:
    """The replay's in-process arms: golden, its fp32-accumulation floor, the twin (the exact
    profile with mlx-vlm's HISA setting) and the twin in fp64 (the twin's floor)."""
    from kernel_toggles import ToggleSet
    ts = ToggleSet.parse(hisa)
    return {R.GOLDEN: Numerics("reference"), R.FLOOR: Numerics("reference", torch.float32),
            TWIN: ts.numerics("exact"), I.TWIN_FLOOR: ts.numerics("exact", compute_dtype=torch.float64)}



class TapsError(RuntimeError):
    pass


def engine_taps(model_dir: Path, weights: str, route: str, ids: list[int], install: paths.Install | None = None,
                patches=()) -> dict[str, np.ndarray]:
    """mlx-vlm's tensors over `ids` by `route` (with candidate fixes `patches`), from the
    harness in its own venv."""
    with tempfile.TemporaryDirectory() as d:
        np.save(Path(d) / "ids.npy", np.asarray(ids, np.int64))
        out = Path(d) / "taps.npz"
        r = subprocess.run([str((install or paths.pinned()).python()), str(paths.HARNESS), "taps", "--model",
                            str(model_dir), "--weights", weights, "--route", route, "--ids", str(Path(d) / "ids.npy"),
                            "--out", str(out), *[a for p in patches for a in ("--patch", p)]],
                           capture_output=True, text=True, errors="replace")
        if r.returncode != 0:
            raise TapsError(f"mlx-vlm's harness failed (exit {r.returncode}): {r.stderr[-1500:]}")
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def rotated(engine: dict) -> dict:
    """mlx-vlm's indexer keys Hadamard-rotated as the golden stores them (the golden rotates
    queries and keys alike, mlx-vlm neither: the scores are the same, the vectors are not)."""
    from reference_model.primitives import hadamard
    return {k: (hadamard(torch.tensor(np.asarray(v, np.float64)), torch.float64).numpy()
                if k.startswith("lid_comp-") else v) for k, v in engine.items()}


def golden_taps(weights, nx: Numerics, ids: list[int], calls: list[int] | None) -> Taps:
    """An arm's taps over `ids`, extended in the same calls as the route (None: one call)."""
    model = build_model(weights, nx)
    taps = Taps(["embed"] + [f"layers.*.{g}" for g, _ in PAIRS])
    st, a = None, 0
    for c in calls or [len(ids)]:
        _, st = model.extend(torch.tensor(ids[a:a + c]), st, "none", taps)
        a += c
    return taps


def crossing(ratio: int, n_entries: int, calls: list[int] | None) -> np.ndarray:
    """Per compressed entry: whether the window before it was completed in an earlier call
    than its own (its overlap half then has to come from state kept across calls)."""
    ends = np.cumsum(calls or [n_entries * ratio])
    call_of = lambda tok: int(np.searchsorted(ends, tok, side="right"))  # noqa: E731
    last = [call_of(ratio * j + ratio - 1) for j in range(n_entries)]
    return np.array([j > 0 and last[j - 1] != last[j] for j in range(n_entries)])


def isolated_compressors(engine: dict, weights, arms: dict, calls: list[int] | None) -> pd.DataFrame:
    """Each compressor fed mlx-vlm's own attention input (attn_norm) from an empty state, per
    arm: entry by entry, which of mlx-vlm's entries depart from every modelled arm (further
    than FACTOR x the twin's floor there, floored at float32 rounding), and how those split
    between entries whose previous window was completed in an earlier call and the others."""
    cfg, rows = weights.cfg, []
    models = {name: build_model(weights, nx) for name, nx in arms.items()}
    for i in range(cfg.n_layers):
        if f"attn_norm-{i}" not in engine:
            continue
        x = torch.tensor(np.asarray(engine[f"attn_norm-{i}"])).reshape(-1, cfg.dim)
        got = {}
        for name, m in models.items():
            taps = Taps([f"layers.{i}.{g}" for g, _ in COMPRESSORS.values()])
            m.attention(i, m._weights(i), x.to(m.nx.cd), m.new_state(), 0,
                        lambda n, v, t=taps: t.put(f"layers.{i}.{n}", v), "prefill")
            got[name] = taps
        for key, (tap, what) in COMPRESSORS.items():
            if f"{key}-{i}" not in engine or f"layers.{i}.{tap}" not in got[R.GOLDEN]:
                continue
            mine = np.asarray(engine[f"{key}-{i}"], np.float64)
            ref = {n: t[f"layers.{i}.{tap}"].double().numpy() for n, t in got.items()}
            if mine.shape != ref[TWIN].shape:
                raise TapsError(f"mlx-vlm wrote {mine.shape[0]} entries of {key}-{i}, the golden {ref[TWIN].shape[0]}")
            err = {n: _rows_rel(mine, r) for n, r in ref.items() if n not in R.FLOORS}
            floor = np.maximum(_rows_rel(ref[I.TWIN_FLOOR], ref[TWIN]), R.F32_ROUNDING)
            best = np.min(np.stack(list(err.values())), 0)
            off = best > R.FACTOR * floor
            cross = crossing(cfg.compress_ratios[i], len(mine), calls)
            rows.append({"layer": i, "tensor": key, "what": what, "entries": len(mine), "departing": int(off.sum()),
                         "crossing": int(cross.sum()), "departing_crossing": int((off & cross).sum()),
                         "departing_within": int((off & ~cross).sum()),
                         "first": int(np.flatnonzero(off)[0]) if off.any() else None,
                         "error_min": float(best[off].min()) if off.any() else None,
                         "error_max": float(best.max()), "floor": float(floor.max()),
                         "error_crossing": float(best[cross].max()) if cross.any() else None,
                         "error_within": float(best[~cross].max()) if (~cross).any() else None,
                         "x_floor": float((best / floor).max())})
    return pd.DataFrame(rows)


def _rows_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Relative L2 error of each row of a against b (infinite where either is not finite)."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    e = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-300)
    return np.where(np.isfinite(a).all(1) & np.isfinite(b).all(1), e, np.inf)


def causality(model_dir: Path, weights: str, route: str, ids: list[int], at: int,
              install: paths.Install | None = None, engine: dict | None = None, patches=()) -> dict:
    """The route's log-probs at positions before `at`, with the tokens from `at` on replaced
    (the same tokens in another order): the largest change, and the first position it is
    above float32 rounding (a causal forward changes none)."""
    a = (engine if engine is not None else engine_taps(model_dir, weights, route, ids, install, patches))["logprobs"]
    rest = list(ids[at:])
    other = list(ids[:at]) + rest[1:] + rest[:1]
    b = engine_taps(model_dir, weights, route, other, install, patches)["logprobs"]
    d = np.abs(a[:at] - b[:at]).max(1)
    moved = np.flatnonzero(d > 1e-4)
    return {"at": at, "max_change": float(d.max()), "first_moved": int(moved[0]) if len(moved) else None,
            "moved": int(len(moved))}


@dataclass
class Run:
    """One replay: mlx-vlm's tensors, every arm's taps, the propagated table, the isolated
    blocks and the compressors, the route's calls."""
    engine: dict
    taps: dict
    table: pd.DataFrame
    iso: dict
    compressors: pd.DataFrame
    calls: list[int] | None


def run(model_dir: Path, weights_src, ids: list[int], route: str, engine_weights: str = "f32",
        install: paths.Install | None = None, patches=()) -> Run:
    """mlx-vlm (`engine_weights`, loaded from `model_dir`, with candidate fixes `patches`) by
    `route` against the golden's arms on `weights_src` (the same checkpoint, read by our loader)."""
    arms = replay_arms(hisa_of(model_dir))
    calls = routes(route, len(ids))
    engine = rotated(engine_taps(model_dir, engine_weights, route, ids, install, patches))
    taps = {name: golden_taps(weights_src, nx, ids, calls) for name, nx in arms.items()}
    # a tensor mlx-vlm does not expose on this route (its fused 2-8 token MoE returns the stream) is left out
    pairs = [(g, e) for g, e in PAIRS if any(k.startswith(f"{e}-") for k in engine)]
    table = R.compare(engine, taps, weights_src.cfg.n_layers, TWIN, pairs, "mlx-vlm")
    iso = {"attention": I.isolated_attention(engine, weights_src, arms, TWIN),
           "router": I.isolated_router(engine, weights_src, arms, ids, TWIN),
           "MoE": I.isolated_moe(engine, weights_src, arms, TWIN)}
    return Run(engine, taps, table, iso, isolated_compressors(engine, weights_src, arms, calls), calls)


def route_kl(engine: dict, weights, ids: list[int], calls, twin: Numerics) -> dict:
    """KL(twin || mlx-vlm) over the route's positions (the twin extended in the same calls)."""
    model = build_model(weights, twin)
    parts, st, a = [], None, 0
    for c in calls or [len(ids)]:
        lg, st = model.extend(torch.tensor(ids[a:a + c]), st, "all")
        parts.append(torch.log_softmax(lg.double(), -1).numpy())
        a += c
    p, q = np.concatenate(parts), np.asarray(engine["logprobs"], np.float64)
    kl = (np.exp(p) * (p - q)).sum(-1)
    return {"positions": len(kl), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "worst_position": int(kl.argmax()), "kl_position0": float(kl[0]),
            "same_top1": float((p.argmax(-1) == q.argmax(-1)).mean())}


def findings(r: Run, route: str, weights: str) -> dict:
    """The replay's judgement on one route: the first block that departs from every modelled
    arm when fed mlx-vlm's own inputs, the compressors' departing entries and whether they are
    the entries whose previous window crossed a call, the propagated stream, the picks."""
    order = list(r.iso)
    blocks = [b for b in (R.block_unexplained(t, name) for name, t in r.iso.items()) if b]
    comps = [c for c in r.compressors.to_dict("records") if c["departing"]]
    attn = r.iso.get("attention", pd.DataFrame())
    picks = I.selections(attn)
    return {"route": route, "weights": weights, "calls": len(r.calls) if r.calls else 1, "twin": TWIN,
            "compressors": comps, "compressors_checked": len(r.compressors),
            "block": min(blocks, key=lambda b: (b["layer"], order.index(b["block"]))) if blocks else None,
            "blocks": blocks, "picks": picks, "unexplained": R.first_unexplained(r.table, TWIN)}


def across_calls(c: dict) -> bool:
    """Whether a compressor's departure is the entries whose preceding window crossed a call:
    every such entry departs, and the others match or depart at least CROSS_RATIO x less."""
    if not c["crossing"] or c["departing_crossing"] != c["crossing"]:
        return False
    return not c["departing_within"] or c["error_crossing"] >= CROSS_RATIO * c["error_within"]


def _entries(c: dict) -> str:
    """Which of a compressor's entries depart, read against the calls they were made in."""
    n, off, cross = c["entries"], c["departing"], c["crossing"]
    head = (f"{off} of {n} compressed entries depart (relative error {c['error_min']:.2g}-{c['error_max']:.2g}, up "
            f"to {c['x_floor']:.2g}x the twin's floor)")
    if across_calls(c) and not c["departing_within"]:
        return f"{head}: exactly the {cross} whose preceding window was completed in an earlier call; the other {n - cross} match"
    if across_calls(c):
        return (f"{head}: the {cross} whose preceding window was completed in an earlier call by up to "
                f"{c['error_crossing']:.2g}, the other {n - cross} by up to {c['error_within']:.2g}")
    if not cross:
        return f"{head}, all made in the same call as their preceding window"
    return (f"{head}: {c['departing_crossing']} of the {cross} whose preceding window was completed in an earlier "
            f"call and {c['departing_within']} of the {n - cross} others")


def _fold(vals, low: bool):
    vals = [v for v in vals if v is not None]
    return None if not vals else (min(vals) if low else max(vals))


def compressor_words(comps: list[dict]) -> str:
    """Departing compressors in words, one clause per layer: the attention's and the
    indexer's compressor together when their entries depart alike."""
    by_layer: dict[int, list[dict]] = {}
    for c in comps:
        by_layer.setdefault(c["layer"], []).append(c)
    out = []
    for layer, cs in by_layer.items():
        same = len(cs) > 1 and len({(c["entries"], c["departing"], c["departing_crossing"], across_calls(c))
                                    for c in cs}) == 1
        if same:
            c = {**cs[0], **{k: _fold([x[k] for x in cs], k == "error_min")
                             for k in ("error_min", "error_max", "x_floor", "error_crossing", "error_within")}}
            out.append(f"layer {layer}, {' and '.join(x['what'] for x in cs)} alike: {_entries(c)}")
        else:
            out += [f"layer {layer}, {c['what']}: {_entries(c)}" for c in cs]
    return "; ".join(out)


def headline(f: dict) -> list[str]:
    """The replay of one route in words: the compressors first (the finest place a departure
    can be put), the first departing block, the picks, the propagated stream."""
    route, lines = f"mlx-vlm ({f['route']}, {f['weights']} weights, {f['calls']} call(s))", []
    if f["compressors"]:
        lines.append(f"{route}, fed its own inputs, departs from its twin ({f['twin']}) in its compressors: "
                     + compressor_words(f["compressors"]) + ".")
    elif f["compressors_checked"]:
        lines.append(f"{route}: fed its own inputs, every compressed entry matches its twin ({f['twin']}).")
    b = f["block"]
    if b is not None:
        lines.append(f"First block that departs fed its own inputs: layer {b['layer']} {b['block']}, {R._how(b)}.")
    from fidelity.llamacpp.selection import sentence as selection_sentence
    chose = selection_sentence(f["picks"], "mlx-vlm")
    if chose:
        lines.insert(0, chose)
    u = f["unexplained"]
    lines.append(f"Propagated, it stays within {R.FACTOR:g}x the twin's floor at every tensor compared." if u is None
                 else f"Propagated, it first departs at layer {u['layer']} {u['tensor']}: {R._how(u)}.")
    return lines
