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
from .isolated import (TWIN_FLOOR, isolated_attention, isolated_mhc, isolated_moe, isolated_router,
                       rel, selections)
from .selection import departs
from .selection import sentence as selection_sentence

# (golden tap under layers.{i}., llama.cpp tensor name before -{i}), in graph order
PAIRS = [("attn.q", "q"), ("attn.kv", "kv"), ("attn.out", "attn_out"), ("ffn.out", "ffn_out")]
PATTERN = (r"^(embd|(q|kv|attn_norm|attn_out|lid_top_k|hc_attn_post|hc_ffn_pre|hc_post|hc_comb|ffn_out|ffn_norm|"
           r"ffn_moe_topk|ffn_moe_weights_scaled)-\d+(#2)?)$")
FACTOR = 10.0
GOLDEN, FLOOR = "golden", "floor:fp32-accum"
FLOORS = (FLOOR, TWIN_FLOOR)
F32_ROUNDING = 1e-6                    # the smallest floor a relative error is judged against
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
    from fidelity.design.arms import pinned_profile
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


def flagged(f: dict) -> bool:
    """What `fidelity llamacpp replay` flags (its exit code): a block or the propagated stream
    departing from every modelled arm, or picks departing from the twin's."""
    return bool(f["block"] or f["unexplained"] or departs(f["picks"]))


def headline(f: dict) -> list[str]:
    """The replay in words: the first block that departs from every modelled arm when fed
    llama.cpp's own inputs (else that every block matches the twin), the propagated stream
    and the indexer picks as context, what differs by design last."""
    b, u, twin, path = f["block"], f["unexplained"], f["twin"], f["path"]
    fed = ", ".join(k for k, v in f["isolated"].items() if v) or "no"
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
