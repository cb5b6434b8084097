"""Tensor replay on a real engine: llama.cpp's intermediate tensors (tensor_dump.py) beside
the golden's taps on the same ids, layer by layer, and beside the same taps of other
in-process arms (e.g. the `exact` profile: the reference's math without its QAT
simulation), so a departure is placed at its first tensor and matched to the arm that
reproduces it.

Per (layer, tensor) in graph order: the relative L2 error ||engine - arm|| / ||arm|| for
every arm, and the floor -- the fp32-accumulation arm's own error against the golden at
that tap (what a correct implementation with another reduction order differs by). The
first departure is the first tap where the engine's error against the golden exceeds
FACTOR x that floor; an arm reproduces the engine there when its own error to the engine
stays within the floor's. That departure is by design (llama.cpp skips the QAT simulation).

What is not: llama.cpp judged against its twin (the arm its flags map to), each block fed
llama.cpp's *own* inputs -- the attention its `attn_norm` and indexer picks, the MoE its
`ffn_norm`, experts and weights -- so upstream differences and near-tie selection flips
drop out, against the twin's own reduction-order floor (the twin in fp64). The first block
further than FACTOR x that floor from every modelled arm leads the headline."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from reference_model import build_model
from reference_model.taps import Taps

from . import flags, tensor_dump as D
from .selection import engine_picks

# (golden tap under layers.{i}., llama.cpp tensor name before -{i}), in graph order
PAIRS = [("attn.q", "q"), ("attn.kv", "kv"), ("attn.out", "attn_out"), ("ffn.out", "ffn_out")]
PATTERN = (r"^(embd|(q|kv|attn_norm|attn_out|lid_top_k|hc_attn_post|hc_ffn_pre|hc_post|hc_comb|ffn_out|ffn_norm|"
           r"ffn_moe_topk|ffn_moe_weights_scaled)-\d+(#2)?)$")
FACTOR = 10.0
GOLDEN, FLOOR = "golden", "floor:fp32-accum"
TWIN_FLOOR = "twin:fp64-accum"         # the twin accumulating in fp64: its reduction-order floor
FLOORS = (FLOOR, TWIN_FLOOR)
F32_ROUNDING = 1e-6                    # the smallest floor a relative error is judged against
NUDGE_SEEDS = (0, 1)                   # the isolated MoE's quantizer floor: two draws of one-ulp nudges
# llama.cpp's CPU arithmetic as in-process arms: the reference's math without its QAT
# simulation, with the routed experts' activations read as Q8_0 and the BF16-weight GEMMs'
# input as bf16, then also its cache in llama-server's -ctk type (f16 by default; Q8_0
# rotated): its twin (fidelity.llamacpp.flags, docs/real-engines.md)
LLAMA_CPU_ARMS = (f"{flags.PROFILE}:{','.join(flags.LLAMA_CPU)}", flags.twin([]))


def llama_cpu_arms(cache_type: str = "f16") -> tuple[str, ...]:
    """LLAMA_CPU_ARMS with the cache arm of llama.cpp's -ctk `cache_type`."""
    return LLAMA_CPU_ARMS[0], twin_of(cache_type)


def twin_of(cache_type: str = "f16") -> str:
    """llama.cpp's twin under -ctk `cache_type`: the in-process arm its flags map to."""
    return flags.twin(["-ctk", cache_type])


def replay_arms(extra=(), cache_type: str = "f16") -> dict:
    """The in-process arms a replay compares: golden, the fp32-accumulation floor, the exact
    profile, llama_cpu_arms(cache_type) (the last is the twin), the twin accumulating in
    fp64 (its reduction-order floor) and each of `extra`, spelled PROFILE:ARM
    (reference|exact and an arm spelling). A bad spelling is a ValueError naming it."""
    from fidelity.arms import pinned_profile
    from fidelity.pipeline.model import arm_numerics
    from reference_model.numerics import Numerics
    arms = {GOLDEN: arm_numerics("golden", "reference", {}, "v4"),
            FLOOR: Numerics("reference", torch.float32), "exact": Numerics("exact"),
            TWIN_FLOOR: arm_numerics(twin_of(cache_type), "reference", {"compute_dtype": torch.float64}, "v4")}
    for spec in dict.fromkeys([*llama_cpu_arms(cache_type), *extra]):
        profile, arm = pinned_profile(spec)
        if profile is None or not arm:
            raise ValueError(f"--arm {spec!r}: give PROFILE:ARM with PROFILE reference or exact, "
                             "e.g. exact:expert_act_q8_0")
        try:
            arms[spec] = arm_numerics(spec, profile, {}, "v4")
        except ValueError as e:
            raise ValueError(f"--arm {spec!r}: {e}") from None
    return arms


def taps_of(weights, numerics, ids: list[int], path: str) -> Taps:
    """An arm's taps over `ids`: one prefill, or one token at a time (the decode path)."""
    model = build_model(weights, numerics)
    taps = Taps(["embed"] + [f"layers.*.{g}" for g, _ in PAIRS])
    if path == "prefill":
        model.extend(torch.tensor(ids), None, "none", taps)
    else:
        st = None
        for t in ids:
            _, st = model.extend(torch.tensor([t]), st, "none", taps)
    return taps


def rel(a, b) -> float:
    """||a - b|| / ||b||; infinite when either holds a NaN or an infinity (llama.cpp's
    tensor broken: never a NaN that every comparison reads as 'within the floor')."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _err(x: float) -> str:
    return f"relative error {x:.3g}" if np.isfinite(x) else "non-finite values (NaN or infinity)"


def _times(x: float) -> str:
    return f"{x:.0f}x" if np.isfinite(x) else "non-finite"


def _how(d: dict) -> str:
    """How far a departing block or tap is from the closest modelled arm, in words."""
    if not np.isfinite(d["error"]):
        return "non-finite values (NaN or infinity) where every modelled arm is finite"
    return f"{_err(d['error'])} against the closest ({d['closest']}), {d['x_floor']:.0f}x the twin's floor {d['floor']:.2g}"


def compare(engine: dict[str, np.ndarray], arms: dict[str, Taps], n_layers: int,
            twin: str | None = None, pairs=PAIRS, engine_name: str = "llama.cpp") -> pd.DataFrame:
    """One row per (layer, tensor) of `pairs` (golden tap, engine tensor): the engine's error
    against every arm (GOLDEN among them), the golden's reduction-order floor (when FLOOR is)
    and (given the `twin`'s name) the twin's. A tap the golden did not write at a layer (no
    compressed entry yet) is skipped."""
    rows = []
    for i in range(n_layers):
        for gname, lname in pairs:
            if f"layers.{i}.{gname}" not in arms[GOLDEN]:
                continue
            got = engine.get(f"{lname}-{i}")
            ref = arms[GOLDEN][f"layers.{i}.{gname}"].double().numpy()
            if got is None or np.asarray(got).size != ref.size:
                raise D.DumpError(f"{engine_name} tensor {lname}-{i} is missing or has another size "
                                  f"than the golden's layers.{i}.{gname} {tuple(ref.shape)}")
            got = np.asarray(got, np.float64).reshape(ref.shape)
            row = {"layer": i, "tensor": gname, "engine_tensor": f"{lname}-{i}"}
            for name, taps in arms.items():
                row[f"vs {name}"] = rel(got, taps[f"layers.{i}.{gname}"].double().numpy())
            if FLOOR in arms:
                row["floor"] = rel(arms[FLOOR][f"layers.{i}.{gname}"].double().numpy(), ref)
            if twin in arms and TWIN_FLOOR in arms:
                row["twin floor"] = rel(arms[TWIN_FLOOR][f"layers.{i}.{gname}"].double().numpy(),
                                        arms[twin][f"layers.{i}.{gname}"].double().numpy())
            rows.append(row)
    return pd.DataFrame(rows)


def modelled(table: pd.DataFrame) -> list[str]:
    """The columns of the arms that model an engine (every compared arm but the floors)."""
    return [c for c in table.columns if c.startswith("vs ") and c[3:] not in FLOORS]


def _departing(df: pd.DataFrame, floor_col: str) -> tuple[list[int], dict] | None:
    """Rows where the engine is further than FACTOR x the floor column (floored at float32
    rounding) from *every* modelled arm, and the first such row's error, closest arm,
    floor and multiple; None when no row departs."""
    cols = modelled(df)
    floor = np.maximum(df[floor_col].to_numpy(), F32_ROUNDING)
    best = df[cols].min(axis=1).to_numpy()
    off = [int(j) for j in np.flatnonzero(best > FACTOR * floor)]
    if not off:
        return None
    k, r = off[0], df.iloc[off[0]]
    return off, {"layer": int(r.layer), "error": float(best[k]), "closest": min(cols, key=lambda c: r[c])[3:],
                 "floor": float(floor[k]), "x_floor": float(best[k] / floor[k])}


def first_unexplained(table: pd.DataFrame, twin: str) -> dict | None:
    """The first tap (graph order) where the engine is further than FACTOR x the twin's
    reduction-order floor from every modelled arm: what no toggle explains. With how far
    the engine matched a modelled arm before, and the twin's own error there."""
    found = _departing(table, "twin floor")
    if found is None:
        return None
    (k, *_), first = found
    r, within = table.iloc[k], table.iloc[:k]
    return {**first, "tensor": r.tensor, "engine_tensor": r.engine_tensor, "twin_error": float(r[f"vs {twin}"]),
            "matched_to": (None if within.empty else {"layer": int(within.iloc[-1].layer),
                                                       "tensor": within.iloc[-1].tensor})}


def block_unexplained(iso: pd.DataFrame, block: str) -> dict | None:
    """The first layer whose `block` (attention or MoE), fed llama.cpp's own inputs, is
    further than FACTOR x the twin's floor there from every modelled arm: upstream
    differences drop out, so this places a departure at its block."""
    found = None if iso.empty or "floor" not in iso else _departing(iso, "floor")
    if found is None:
        return None
    off, first = found
    return {"block": block, **first, "layers": [int(iso.iloc[j].layer) for j in off]}


def first_departure(table: pd.DataFrame) -> dict | None:
    """The first tap (graph order) where the engine leaves the golden by more than FACTOR x
    the floor, with the arms that reproduce it there (their error to the engine within
    the floor's, floored at float32 rounding)."""
    off = table[table[f"vs {GOLDEN}"] > FACTOR * table.floor]
    if off.empty:
        return None
    r = off.iloc[0]
    tol = max(float(r.floor), 1e-6)
    arms = [c[3:] for c in modelled(table) if c != f"vs {GOLDEN}" and r[c] <= tol]
    return {"layer": int(r.layer), "tensor": r.tensor, "engine_tensor": r.engine_tensor,
            "error": float(r[f"vs {GOLDEN}"]), "floor": float(r.floor),
            "x_floor": float(r[f"vs {GOLDEN}"] / max(r.floor, 1e-300)), "reproduced_by": arms}


def isolated_moe(engine: dict[str, np.ndarray], weights, arms: dict, twin: str | None = None) -> pd.DataFrame:
    """Each layer's MoE fed llama.cpp's own input, expert choice and routing weights
    (ffn_norm, ffn_moe_topk, ffn_moe_weights_scaled), once per in-process arm: the arm's
    relative error to llama.cpp's ffn_out there. Upstream differences drop out, so an arm
    that matches to float32 rounding computes the experts as llama.cpp does. `floor`: the
    larger of the `twin` in fp64 against the twin on the same inputs (reduction order) and
    the twin fed its input nudged by one float32 ulp (nudged, twice): the experts' activations are
    quantized (Q8_0), and an engine that computes the same quantizer a rounding apart (x * 1/d
    for x / d) flips a step wherever a value sits on a boundary -- which inputs happen to, so
    without it a clean build departed at one layer by 50x a floor that has no such flips."""
    from reference_model.model import moe_experts
    rows = []
    for i in range(weights.cfg.n_layers):
        need = [f"{n}-{i}" for n in ("ffn_norm", "ffn_moe_topk", "ffn_moe_weights_scaled", "ffn_out")]
        if any(k not in engine for k in need):
            continue
        x, idx, wt, out = (np.asarray(engine[k]) for k in need)
        k = idx.size // x.shape[0]
        lw = weights.layer_weights(i)

        def experts(nx, inp):
            return moe_experts(nx, weights.cfg, lw, torch.tensor(inp).to(nx.cd), torch.tensor(idx.reshape(-1, k)).long(),
                               torch.tensor(wt.reshape(-1, k)).to(nx.cd)).double().numpy()
        row, ys = {"layer": i}, {}
        for name, nx in arms.items():
            ys[name] = experts(nx, x)
            row[f"vs {name}"] = rel(out, ys[name])
        _floored(row, ys, twin, rel)
        if "floor" in row:
            row["floor"] = max([row["floor"]] + [rel(experts(arms[twin], nudged(x, seed)), ys[twin])
                                                 for seed in NUDGE_SEEDS])
        rows.append(row)
    return pd.DataFrame(rows)


def nudged(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """x with every element moved one float32 ulp up or down (a fixed random sign): the
    smallest difference two correct implementations of the same arithmetic can feed a
    quantizer."""
    x = np.asarray(x, np.float32)
    up = np.random.default_rng(seed).random(x.shape) < 0.5
    return np.where(up, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))).astype(np.float32)


def isolated_attention(engine: dict[str, np.ndarray], weights, arms: dict, twin: str | None = None,
                       needle_positions=()) -> pd.DataFrame:
    """Each layer's attention fed llama.cpp's own input (attn_norm) from an empty cache and,
    at CSA layers, its own indexer picks (lid_top_k), once per in-process arm: the arm's
    relative error to llama.cpp's attn_out. Upstream differences and near-tie selection
    flips drop out, so what remains is the attention's own arithmetic. Also per CSA layer
    llama.cpp's picks against the twin's on the same input (fidelity.llamacpp.selection:
    `selection`, with the needle's entries when `needle_positions` are given).
    `floor`: the `twin` in fp64 against the twin (prefill only)."""
    from reference_model import build_model
    rows = []
    models = {name: build_model(weights, nx) for name, nx in arms.items()}
    for i in range(weights.cfg.n_layers):
        if f"attn_norm-{i}" not in engine or f"attn_out-{i}" not in engine:
            continue
        x, out = np.asarray(engine[f"attn_norm-{i}"]), np.asarray(engine[f"attn_out-{i}"])
        x = x.reshape(-1, weights.cfg.dim)
        picks = engine.get(f"lid_top_k-{i}")
        picks = None if picks is None else np.asarray(picks).reshape(x.shape[0], -1)
        row, ys = {"layer": i}, {}
        for name, m in models.items():
            mi = m if picks is None else m.with_numerics(m.nx.with_kernels("engine picks", index_topk=engine_picks(picks)))
            ys[name] = mi.attention(i, mi._weights(i), torch.tensor(x).to(mi.nx.cd), mi.new_state(), 0, None,
                                    "prefill").double().numpy()
            row[f"vs {name}"] = rel(out.reshape(ys[name].shape), ys[name])
        _floored(row, ys, twin, rel)
        if picks is not None and twin in models and TWIN_FLOOR in models:
            row["selection"] = _selection(models[twin], models[TWIN_FLOOR], i, x, picks,
                                          weights.cfg.compress_ratios[i], needle_positions)
        rows.append(row)
    return pd.DataFrame(rows)


def selections(attn: pd.DataFrame) -> list[dict]:
    """The isolated attention's per-layer selection records (CSA layers only)."""
    return [r for r in attn.get("selection", pd.Series(dtype=object)) if isinstance(r, dict)]


def _selection(twin, twin64, i: int, x: np.ndarray, picks: np.ndarray, ratio: int, needle_positions) -> dict:
    """llama.cpp's picks at layer i against the twin's, judged on the twin's scores (selection.py)."""
    from . import selection as S
    s, own = S.scores_and_picks(twin, i, x)
    s64, _ = S.scores_and_picks(twin64, i, x)
    ents = S.needle_entries(needle_positions, ratio) if len(needle_positions) else None
    return {"layer": i, **S.compare(picks, own, s, s64, ents)}


def _floored(row: dict, ys: dict, twin: str | None, err) -> dict:
    """`row` with the twin-in-fp64 floor `err(ys[TWIN_FLOOR], ys[twin])` when both ran."""
    if twin in ys and TWIN_FLOOR in ys:
        row["floor"] = err(ys[TWIN_FLOOR], ys[twin])
    return row


def isolated_router(engine: dict[str, np.ndarray], weights, arms: dict, ids: list[int],
                    twin: str | None = None) -> pd.DataFrame:
    """Each layer's router fed llama.cpp's own MoE input (ffn_norm) and token ids, once per
    arm: the relative error of its routing weights, as a dense tokens x experts matrix, to
    llama.cpp's (ffn_moe_topk, ffn_moe_weights_scaled). The isolated MoE is fed llama.cpp's
    scaled weights, so a routing or scaling bug shows here, not there."""
    cfg, rows = weights.cfg, []
    tokens = torch.tensor(ids)

    def dense(idx, wt):
        d = np.zeros((idx.shape[0], cfg.n_routed_experts))
        np.put_along_axis(d, idx.astype(np.int64), wt.astype(np.float64), 1)
        return d
    for i in range(cfg.n_layers):
        need = [f"{n}-{i}" for n in ("ffn_norm", "ffn_moe_topk", "ffn_moe_weights_scaled")]
        if any(k not in engine for k in need):
            continue
        x, idx, wt = (np.asarray(engine[k]) for k in need)
        k = idx.size // x.shape[0]
        theirs = dense(idx.reshape(-1, k), wt.reshape(-1, k))
        lw = weights.layer_weights(i)
        row, ys = {"layer": i}, {}
        for name, nx in arms.items():
            xx = torch.tensor(np.array(x)).to(nx.cd)
            scores = nx.moe_gate(xx, lw["ffn.gate.weight"], cfg.score_func)
            hashed = cfg.is_hash_layer(i)
            bias = None if hashed else lw["ffn.gate.bias"]
            pick = nx.moe_select(scores, bias, tokens, lw.get("ffn.gate.tid2eid"), cfg.n_activated_experts, i, hashed)
            w = nx.route_weights(scores, pick, bias, cfg.route_scale, renormalize=cfg.score_func != "softmax")
            ys[name] = dense(pick.numpy(), w.double().numpy())
            row[f"vs {name}"] = rel(theirs, ys[name])
        rows.append(_floored(row, ys, twin, rel))
    return pd.DataFrame(rows)


def isolated_mhc(engine: dict[str, np.ndarray], weights, arms: dict, twin: str | None = None) -> pd.DataFrame:
    """Each layer's FFN-site mHC fed llama.cpp's own stream after attention (hc_attn_post),
    once per arm: the largest relative error of its collapse (hc_ffn_pre), post and comb
    weights (the site's `hc_post` / `hc_comb`, the layer's second of each) to llama.cpp's."""
    from reference_model import build_model
    rows = []
    cfg = weights.cfg
    models = {name: build_model(weights, nx) for name, nx in arms.items()}
    for i in range(cfg.n_layers):
        need = [f"hc_attn_post-{i}", f"hc_ffn_pre-{i}", f"hc_post-{i}#2", f"hc_comb-{i}#2"]
        if any(k not in engine for k in need):
            continue
        H, x, post, comb = (np.asarray(engine[k], np.float64) for k in need)
        n = x.shape[0]
        H = H.reshape(n, cfg.hc_mult, cfg.dim)
        row, ys = {"layer": i}, {}
        for name, m in models.items():
            got = m.mhc.site(torch.tensor(H).to(m.nx.cd), None, m._weights(i), "ffn")[:3]
            ys[name] = [t.double().numpy() for t in got]
            row[f"vs {name}"] = max(rel(e.reshape(o.shape), o) for e, o in zip((x, post, comb), ys[name]))
        rows.append(_floored(row, ys, twin, lambda a, b: max(rel(u, v) for u, v in zip(a, b))))
    return pd.DataFrame(rows)


@dataclass
class Run:
    """One replay: llama.cpp's tensors, every arm's taps, the propagated table and the
    isolated blocks (in graph order within a layer)."""
    engine: dict
    taps: dict
    table: pd.DataFrame
    iso: dict


def run(gguf: Path, weights, ids: list[int], arms: dict, workdir: Path, path: str = "prefill",
        cache: str = "f16", build=None, needle_positions=()) -> Run:
    """llama.cpp on `gguf` with its KV cache in `cache` vs in-process `arms` (name ->
    Numerics; must hold GOLDEN and FLOOR) over `ids` by `path`, dumped by `build`
    (fidelity.llamacpp.paths.Build; default the pinned one). The isolated blocks:
    attention (prefill path only: empty otherwise), the FFN site's mHC, router, MoE."""
    dump = D.run(gguf, ids, Path(workdir) / f"dump-{path}-{cache}.bin", path, PATTERN, cache, build)
    engine = D.read(dump)
    taps = {name: taps_of(weights, nx, ids, path) for name, nx in arms.items()}
    twin = twin_of(cache)
    table = compare(engine, taps, weights.cfg.n_layers, twin)
    attn = (isolated_attention(engine, weights, arms, twin, needle_positions) if path == "prefill"
            else pd.DataFrame())
    iso = {"attention": attn, "mHC": isolated_mhc(engine, weights, arms, twin),
           "router": isolated_router(engine, weights, arms, ids, twin),
           "MoE": isolated_moe(engine, weights, arms, twin)}
    return Run(engine, taps, table, iso)


def replay(gguf: Path, weights, ids: list[int], arms: dict, workdir: Path, path: str = "prefill",
           cache: str = "f16"):
    """(table, first departure from the golden, isolated blocks) of run(...)."""
    r = run(gguf, weights, ids, arms, workdir, path, cache)
    return r.table, first_departure(r.table), r.iso


def sentence(first: dict | None, path: str) -> str:
    """The departure from the golden in words (by design when an arm reproduces it)."""
    if first is None:
        return f"llama.cpp ({path}) stays within {FACTOR:g}x the floor of the golden at every tensor compared."
    who = (f"reproduced in-process by {', '.join(first['reproduced_by'])}" if first["reproduced_by"]
           else "no in-process arm compared reproduces it")
    return (f"llama.cpp ({path}) first departs from the golden at layer {first['layer']} {first['tensor']} "
            f"({first['engine_tensor']}): {_err(first['error'])}, {first['x_floor']:.0f}x the "
            f"floor {first['floor']:.2g}; {who}.")


def findings(table: pd.DataFrame, iso: dict[str, pd.DataFrame], path: str, cache: str = "f16",
             search: dict | None = None) -> dict:
    """The replay's judgement: what no modelled arm explains -- each block fed llama.cpp's
    own inputs (`iso`: block -> table, in graph order within a layer; the first departing
    block leads), the propagated stream, the indexer picks that differ, the twin search's
    result when one ran (fidelity.llamacpp.twin_search) -- and the departure from the golden."""
    order = list(iso)
    blocks = [b for b in (block_unexplained(t, name) for name, t in iso.items()) if b]
    first = min(blocks, key=lambda b: (b["layer"], order.index(b["block"]))) if blocks else None
    attn = iso.get("attention", pd.DataFrame())
    picks = selections(attn)
    errors = {name: [{"layer": int(r.layer), "error": float(r[modelled(t)].min()), "floor": float(r.floor)}
                     for _, r in t.iterrows()] for name, t in iso.items() if not t.empty and "floor" in t}
    return {"twin": twin_of(cache), "path": path, "block": first, "blocks": blocks, "errors": errors,
            "isolated": {name: not t.empty for name, t in iso.items()}, "picks": picks,
            "unexplained": first_unexplained(table, twin_of(cache)), "by_design": first_departure(table),
            "search": search}


def headline(f: dict) -> list[str]:
    """The replay in words: the first block that departs from every modelled arm when fed
    llama.cpp's own inputs (else that every block matches the twin), the propagated stream
    and the indexer picks as context, what differs by design last."""
    b, u, twin, path = f["block"], f["unexplained"], f["twin"], f["path"]
    fed = ", ".join(k for k, v in f["isolated"].items() if v) or "no"
    from .selection import sentence as selection_sentence
    chose = selection_sentence(f["picks"])
    lines = [chose] if chose else []              # the seeds' class first: it loses needles at length
    if b is not None:
        more = [x for x in f["blocks"] if (x["block"], x["layer"]) != (b["block"], b["layer"])]   # also read back from JSON
        also = "".join(f"; the {x['block']} at layer {x['layer']} too ({_times(x['x_floor'])})" for x in more)
        lines.append(f"llama.cpp ({path}) departs from its twin ({twin}) at layer {b['layer']} {b['block']}, fed "
                     f"its own inputs: {_how(b)}{also}.")
    elif fed != "no":
        lines.append(f"Fed llama.cpp's own inputs, every block of llama.cpp ({path}) compared ({fed}) matches "
                     f"its twin ({twin}) within {FACTOR:g}x the twin's floor.")
    ties = [p for p in f["picks"] if p["differ"] and not p["beyond"]]
    if ties:
        lines.append("Its indexer picks differ from the twin's only at ties (within the scores' floor) on " + ", ".join(
            f"{p['differ']} of {p['rows']} rows at layer {p['layer']}" for p in ties) + ".")
    if u is None:
        lines.append(f"Propagated, it stays within {FACTOR:g}x the twin's floor of a modelled arm at every tensor.")
    else:
        upto = (f"to layer {u['matched_to']['layer']} {u['matched_to']['tensor']}" if u["matched_to"]
                else "at no tensor")
        lines.append(f"Propagated, it matches a modelled arm {upto}, then departs from every one at layer "
                     f"{u['layer']} {u['tensor']} ({u['engine_tensor']}): {_how(u)}.")
    if f.get("search"):
        lines.append(f["search"]["sentence"])
    lines.append("By design: " + sentence(f["by_design"], path))
    return lines
