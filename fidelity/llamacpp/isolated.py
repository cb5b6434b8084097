"""llama.cpp's blocks fed its *own* inputs, once per in-process arm (fidelity.llamacpp.replay's
second judgement): the attention its `attn_norm` and indexer picks, the FFN-site mHC its
stream after attention, the router its MoE input and ids, the MoE its `ffn_norm`, experts
and weights. Upstream differences and near-tie selection flips drop out, so what remains is
each block's own arithmetic, judged against the twin's floor there: the twin in fp64 against
the twin (reduction order) and, for the MoE, the twin fed its input one ulp apart (a
quantizer's rounding boundary)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from reference_model import build_model

from .selection import engine_picks

TWIN_FLOOR = "twin:fp64-accum"         # the twin accumulating in fp64: its reduction-order floor
NUDGE_SEEDS = (0, 1)                   # the isolated MoE's quantizer floor: two draws of one-ulp nudges


def rel(a, b) -> float:
    """||a - b|| / ||b||; infinite when either holds a NaN or an infinity (llama.cpp's
    tensor broken: never a NaN that every comparison reads as 'within the floor')."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


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
