"""Why mlx-vlm departs from the golden, in one run: the same prompt through each route a
program can drive mlx-vlm's DeepSeek-V4 by (one call with its cache, one token per call,
chunks, one call without a cache), each against its twin computed in the same calls --
the KL per route says which routes depart; the replay of each departing route puts the
departure at its tensor (fidelity.mlxvlm.replay); a causality probe says whether a position
reads later tokens. The sentences are what a maintainer acts on; the tables are written
beside them."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from . import replay as X
from .harness import routes

ROUTES = ("prefill", "chunked:64", "decode", "nocache")
FLOOR_MIN = 1e-9        # KL below this is float64 arithmetic on float32 logits, not a distribution moving
DEPARTS = 10.0          # a route departs when its mean KL is this many times the twin's own floor


def twin_floor(weights, ids: list[int]) -> float:
    """Mean KL between the twin in fp32 and in fp64 over one prefill: what float32 rounding
    alone moves the exact profile's distributions by."""
    import numpy as np
    import torch

    from reference_model import build_model
    from reference_model.numerics import Numerics
    lp = [torch.log_softmax(build_model(weights, Numerics("exact", dt)).extend(torch.tensor(ids), None, "all")[0]
                            .double(), -1).numpy() for dt in (torch.float64, torch.float32)]
    return float((np.exp(lp[0]) * (lp[0] - lp[1])).sum(-1).mean())


def explain(model_dir: Path, weights_src, ids: list[int], engine_weights: str = "f32", route_list=ROUTES,
            install=None, progress=print, patches=()) -> dict:
    """Every route's KL against its twin, replay and causality; the explanation in words
    (of mlx-vlm with candidate fixes `patches`, when given)."""
    out = {"tokens": len(ids), "weights": engine_weights, "patches": list(patches), "twin_floor_kl": twin_floor(weights_src, ids), "routes": []}
    for route in route_list:
        progress(f"route {route}: mlx-vlm's taps and the golden's arms over {len(ids)} tokens")
        r = X.run(model_dir, weights_src, ids, route, engine_weights, install, patches)
        kl = X.route_kl(r.engine, weights_src, ids, r.calls, X.replay_arms(X.hisa_of(model_dir))[X.TWIN])
        causal = X.causality(model_dir, engine_weights, route, ids, len(ids) // 2, install, r.engine, patches)
        f = X.findings(r, route, engine_weights)
        floor = max(out["twin_floor_kl"], FLOOR_MIN)
        out["routes"].append({"route": route, **kl, "x_floor": kl["kl_mean"] / floor,
                              "departs": kl["kl_mean"] > DEPARTS * floor, "causality": causal,
                              "findings": f, "lines": X.headline(f), "table": r.table, "compressors": r.compressors,
                              "iso": r.iso})
    out["sentence"] = sentence(out)
    return out


def _route_words(x: dict) -> str:
    return f"{x['route']}: mean KL {x['kl_mean']:.2g} ({x['x_floor']:.2g}x), max {x['kl_max']:.2g}"


def sentence(e: dict) -> list[str]:
    """The explanation: which routes match, and for each departing route where and why."""
    fine = [x for x in e["routes"] if not x["departs"] and x["causality"]["first_moved"] is None]
    bad = [x for x in e["routes"] if x not in fine]
    lines = [f"Against its twin (the exact profile computed in the same calls; float32 against float64 arithmetic "
             f"moves it by a mean KL of {e['twin_floor_kl']:.2g}, counted as at least {FLOOR_MIN:g}), over "
             f"{e['tokens']} tokens with {e['weights']} weights"
             + (f", patched with {', '.join(e['patches'])} (not mlx-vlm as shipped)" if e["patches"] else "") + ":"]
    if fine:
        lines.append("matches on " + "; ".join(_route_words(x) for x in fine) + ".")
    for x in bad:
        c, f = x["causality"], x["findings"]
        why = []
        crossing = [k for k in f["compressors"] if X.across_calls(k)]
        if crossing:
            why.append("its overlapping (ratio-4) compressors do not carry the previous window across calls: "
                       + X.compressor_words(crossing))
        flips = [p for p in f["picks"] if p["beyond"]]
        if flips:
            why.append("its indexer, fed the same inputs, then picks other entries (beyond the scores' floor) on "
                       + ", ".join(f"{p['beyond']} of {p['rows']} rows at layer {p['layer']}" for p in flips))
        rest = [k for k in f["compressors"] if k not in crossing]
        if rest:
            why.append(("and" if crossing else "its") + " compressors depart: " + X.compressor_words(rest))
        if c["first_moved"] is not None:
            why.append(f"it is not causal: changing the tokens from position {c['at']} on moves the log-probs of "
                       f"{c['moved']} earlier positions (from position {c['first_moved']}, by up to "
                       f"{c['max_change']:.2g})")
            if f["block"] is not None:
                why.append(f"the first block that departs fed its own inputs is layer {f['block']['layer']} "
                           f"{f['block']['block']}")
        if not why:
            why.append(" ".join(x["lines"]))
        lines.append(f"departs on {_route_words(x)}: " + "; ".join(why) + ".")
    return lines


def write(e: dict, out: Path) -> Path:
    """routes.csv, per route its propagated table, isolated blocks and compressors, findings.json
    and summary.md under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    keep = ("route", "positions", "kl_mean", "kl_max", "worst_position", "kl_position0", "same_top1", "x_floor",
            "departs")
    pd.DataFrame([{k: x[k] for k in keep} | {"causal": x["causality"]["first_moved"] is None}
                  for x in e["routes"]]).to_csv(out / "routes.csv", index=False)
    for x in e["routes"]:
        tag = x["route"].replace(":", "")
        x["table"].to_csv(out / f"replay-{tag}.csv", index=False)
        x["compressors"].to_csv(out / f"compressors-{tag}.csv", index=False)
        for block, t in x["iso"].items():
            t.to_csv(out / f"isolated-{block.lower()}-{tag}.csv", index=False)
    slim = {**{k: v for k, v in e.items() if k != "routes"},
            "routes": [{k: v for k, v in x.items() if k not in ("table", "compressors", "iso")} for x in e["routes"]]}
    (out / "findings.json").write_text(json.dumps(slim, indent=1, default=str))
    md = ["# mlx-vlm against its twin, route by route", "", *e["sentence"], "",
          "| route | calls | mean KL | x twin floor | max KL | same top-1 | causal |", "|---|---|---|---|---|---|---|"]
    for x in e["routes"]:
        calls = routes(x["route"], e["tokens"])
        md.append(f"| {x['route']} | {len(calls) if calls else 1} | {x['kl_mean']:.3g} | {x['x_floor']:.3g} | "
                  f"{x['kl_max']:.3g} | {x['same_top1']:.4f} | {'yes' if x['causality']['first_moved'] is None else 'no'} |")
    for x in e["routes"]:
        md += ["", f"## {x['route']}", "", *x["lines"]]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return out
