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
stays within the floor's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from reference_model import build_model
from reference_model.taps import Taps

from . import tensor_dump as D

# (golden tap under layers.{i}., llama.cpp tensor name before -{i}), in graph order
PAIRS = [("attn.q", "q"), ("attn.kv", "kv"), ("attn.out", "attn_out"), ("ffn.out", "ffn_out")]
PATTERN = r"^(embd|(q|kv|attn_out|ffn_out|ffn_norm|ffn_moe_topk|ffn_moe_weights_scaled)-\d+)$"
FACTOR = 10.0
GOLDEN, FLOOR = "golden", "floor:fp32-accum"
# llama.cpp's CPU arithmetic as in-process arms: the reference's math without its QAT
# simulation, with the routed experts' activations read as Q8_0, then also its cache in
# llama-server's -ctk type (f16 by default; Q8_0 rotated) (docs/real-engines.md)
LLAMA_CPU_ARMS = ("exact:expert_act_q8_0", "exact:expert_act_q8_0,kv_cache_ggml")


def llama_cpu_arms(cache_type: str = "f16") -> tuple[str, ...]:
    """LLAMA_CPU_ARMS with the cache arm of llama.cpp's -ctk `cache_type`."""
    cpu, cache = LLAMA_CPU_ARMS
    return (cpu, cache if cache_type == "f16" else f"{cache}(type={cache_type})")


def replay_arms(extra=(), cache_type: str = "f16") -> dict:
    """The in-process arms a replay compares: golden, the fp32-accumulation floor, the exact
    profile, llama_cpu_arms(cache_type) and each of `extra`, spelled PROFILE:ARM
    (reference|exact and an arm spelling). A bad spelling is a ValueError naming it."""
    from fidelity.arms import pinned_profile
    from fidelity.pipeline_model import arm_numerics
    from reference_model.numerics import Numerics
    arms = {GOLDEN: arm_numerics("golden", "reference", {}, "v4"),
            FLOOR: Numerics("reference", torch.float32), "exact": Numerics("exact")}
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
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def compare(engine: dict[str, np.ndarray], arms: dict[str, Taps], n_layers: int) -> pd.DataFrame:
    """One row per (layer, tensor): the engine's error against every arm, and the floor."""
    rows = []
    for i in range(n_layers):
        for gname, lname in PAIRS:
            got = engine.get(f"{lname}-{i}")
            ref = arms[GOLDEN][f"layers.{i}.{gname}"].double().numpy()
            if got is None or np.asarray(got).size != ref.size:
                raise D.DumpError(f"llama.cpp tensor {lname}-{i} is missing or has another size "
                                  f"than the golden's layers.{i}.{gname} {tuple(ref.shape)}")
            got = np.asarray(got, np.float64).reshape(ref.shape)
            row = {"layer": i, "tensor": gname, "engine_tensor": f"{lname}-{i}"}
            for name, taps in arms.items():
                row[f"vs {name}"] = rel(got, taps[f"layers.{i}.{gname}"].double().numpy())
            row["floor"] = rel(arms[FLOOR][f"layers.{i}.{gname}"].double().numpy(), ref)
            rows.append(row)
    return pd.DataFrame(rows)


def first_departure(table: pd.DataFrame) -> dict | None:
    """The first tap (graph order) where the engine leaves the golden by more than FACTOR x
    the floor, with the arms that reproduce it there (their error to the engine within
    the floor's, floored at float32 rounding)."""
    off = table[table[f"vs {GOLDEN}"] > FACTOR * table.floor]
    if off.empty:
        return None
    r = off.iloc[0]
    tol = max(float(r.floor), 1e-6)
    arms = [c[3:] for c in table.columns if c.startswith("vs ") and c != f"vs {GOLDEN}" and r[c] <= tol]
    return {"layer": int(r.layer), "tensor": r.tensor, "engine_tensor": r.engine_tensor,
            "error": float(r[f"vs {GOLDEN}"]), "floor": float(r.floor),
            "x_floor": float(r[f"vs {GOLDEN}"] / max(r.floor, 1e-300)), "reproduced_by": arms}


def isolated_moe(engine: dict[str, np.ndarray], weights, arms: dict) -> pd.DataFrame:
    """Each layer's MoE fed llama.cpp's own input, expert choice and routing weights
    (ffn_norm, ffn_moe_topk, ffn_moe_weights_scaled), once per in-process arm: the arm's
    relative error to llama.cpp's ffn_out there. Upstream differences drop out, so an arm
    that matches to float32 rounding computes the experts as llama.cpp does."""
    from reference_model.model import moe_experts
    rows = []
    for i in range(weights.cfg.n_layers):
        need = [f"{n}-{i}" for n in ("ffn_norm", "ffn_moe_topk", "ffn_moe_weights_scaled", "ffn_out")]
        if any(k not in engine for k in need):
            continue
        x, idx, wt, out = (np.asarray(engine[k]) for k in need)
        k = idx.size // x.shape[0]
        lw = weights.layer_weights(i)
        row = {"layer": i}
        for name, nx in arms.items():
            y = moe_experts(nx, weights.cfg, lw, torch.tensor(x).to(nx.cd),
                            torch.tensor(idx.reshape(-1, k)).long(),
                            torch.tensor(wt.reshape(-1, k)).to(nx.cd))
            row[f"vs {name}"] = rel(out, y.double().numpy())
        rows.append(row)
    return pd.DataFrame(rows)


def replay(gguf: Path, weights, ids: list[int], arms: dict, workdir: Path, path: str = "prefill",
           cache: str = "f16"):
    """(table, first departure, isolated MoE table) for llama.cpp on `gguf` with its KV
    cache in `cache` vs in-process `arms` (name -> Numerics; must hold GOLDEN and FLOOR)
    over `ids` by `path`."""
    dump = D.run(gguf, ids, Path(workdir) / f"dump-{path}-{cache}.bin", path, PATTERN, cache)
    engine = D.read(dump)
    taps = {name: taps_of(weights, nx, ids, path) for name, nx in arms.items()}
    table = compare(engine, taps, weights.cfg.n_layers)
    return table, first_departure(table), isolated_moe(engine, weights, arms)


def sentence(first: dict | None, path: str) -> str:
    """The finding in words."""
    if first is None:
        return f"llama.cpp ({path}) stays within {FACTOR:g}x the floor of the golden at every tensor compared."
    who = (f"reproduced in-process by {', '.join(first['reproduced_by'])}" if first["reproduced_by"]
           else "no in-process arm compared reproduces it")
    return (f"llama.cpp ({path}) first departs from the golden at layer {first['layer']} {first['tensor']} "
            f"({first['engine_tensor']}): relative error {first['error']:.3g}, {first['x_floor']:.0f}x the "
            f"floor {first['floor']:.2g}; {who}.")
