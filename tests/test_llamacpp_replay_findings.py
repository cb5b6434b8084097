"""The replay's judgement against the twin, on hand-made tables (no llama.cpp needed):
a block fed llama.cpp's own inputs is unexplained only when it is further than 10x the
twin's floor from *every* modelled arm (the floors are not models), the first such block
in graph order leads (attention before the MoE of the same layer), and the by-design
departure from the golden comes last."""
import json

import pandas as pd

from fidelity.llamacpp import isolated as I
from fidelity.llamacpp import replay as R

TWIN = R.twin_of("f16")


def _iso(errors: dict[str, list[float]], floor: list[float]) -> pd.DataFrame:
    n = len(floor)
    return pd.DataFrame({"layer": range(n), **{f"vs {k}": v for k, v in errors.items()}, "floor": floor})


def test_a_block_is_unexplained_only_beyond_every_modelled_arm():
    moe = _iso({"golden": [0.02, 0.02, 0.4], R.TWIN_FLOOR: [1e-9] * 3, TWIN: [1e-7, 0.35, 0.35],
                "exact": [4e-3, 1e-7, 0.5]}, [1e-7] * 3)
    b = R.block_unexplained(moe, "MoE")
    # layer 1: the twin is far but `exact` reproduces it; the floor arm is no model
    assert (b["layer"], b["layers"], b["closest"]) == (2, [2], TWIN)
    assert b["x_floor"] == 0.35 / 1e-6                     # the floor is floored at float32 rounding
    assert R.block_unexplained(_iso({TWIN: [1e-6] * 2}, [1e-6] * 2), "MoE") is None


def test_the_first_block_in_graph_order_leads_and_by_design_comes_last():
    sel = [None, {"layer": 1, "rows": 200, "k": 4, "engine_k": 4, "differ": 3, "beyond": 0, "worst": None},
           {"layer": 2, "rows": 200, "k": 4, "engine_k": 4, "differ": 0, "beyond": 0, "worst": None}]
    attn = _iso({"golden": [0.03] * 3, TWIN: [1e-5, 1e-5, 0.2]}, [1e-5] * 3).assign(selection=sel)
    moe = _iso({"golden": [0.02] * 3, TWIN: [1e-7, 1e-7, 0.5]}, [1e-7] * 3)
    table = pd.DataFrame({"layer": [0, 0], "tensor": ["attn.q", "attn.out"], "engine_tensor": ["q-0", "attn_out-0"],
                          "vs golden": [0.03, 0.03], f"vs {R.FLOOR}": [0.03, 0.03], f"vs {TWIN}": [1e-6, 0.1],
                          "floor": [4e-5, 5e-4], "twin floor": [1e-6, 1e-6]})
    f = R.findings(table, {"attention": attn, "MoE": moe}, "prefill", "f16")
    assert (f["block"]["block"], f["block"]["layer"]) == ("attention", 2)
    lines = R.headline(f)
    assert R.headline(json.loads(json.dumps(f, default=float))) == lines       # the same read back from its file
    assert lines[0].startswith(f"llama.cpp (prefill) departs from its twin ({TWIN}) at layer 2 attention")
    assert "the MoE at layer 2 too" in lines[0]
    assert "only at ties (within the scores' floor) on 3 of 200 rows at layer 1" in lines[1]
    assert "to layer 0 attn.q, then departs from every one at layer 0 attn.out" in lines[2]
    assert lines[-1].startswith("By design: llama.cpp (prefill) first departs from the golden at layer 0 attn.q")


def test_every_block_matching_is_said_so():
    ok = _iso({TWIN: [1e-6] * 2}, [1e-6] * 2)
    table = pd.DataFrame({"layer": [0], "tensor": ["attn.q"], "engine_tensor": ["q-0"], "vs golden": [1e-7],
                          f"vs {TWIN}": [1e-7], "floor": [4e-5], "twin floor": [1e-7]})
    lines = R.headline(R.findings(table, {"attention": ok, "MoE": ok}, "prefill", "f16"))
    assert lines[0] == (f"Fed llama.cpp's own inputs, every block of llama.cpp (prefill) compared (attention, "
                        f"MoE) matches its twin ({TWIN}) within 10x the twin's floor.")
    assert lines[1].startswith("Propagated, it stays within 10x")
    assert lines[2] == "By design: llama.cpp (prefill) stays within 10x the floor of the golden at every tensor compared."


def test_a_non_finite_engine_tensor_departs_everywhere_it_appears():
    """A llama.cpp tensor holding NaN is infinitely far from every arm (a planted YaRN bug
    whose outputs were NaN read as 'matches its twin' while NaN compared as within floors)."""
    import numpy as np
    assert R.rel(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == float("inf")
    iso = _iso({TWIN: [float("inf")] * 2, "exact": [float("inf")] * 2}, [1e-7] * 2)
    table = pd.DataFrame({"layer": [0], "tensor": ["attn.q"], "engine_tensor": ["q-0"],
                          "vs golden": [float("inf")], f"vs {TWIN}": [float("inf")], "floor": [4e-5],
                          "twin floor": [1e-7]})
    lines = R.headline(R.findings(table, {"MoE": iso}, "prefill", "f16"))
    assert lines[0].startswith(f"llama.cpp (prefill) departs from its twin ({TWIN}) at layer 0 MoE, fed its own "
                               "inputs: non-finite values (NaN or infinity)")
    assert "non-finite values" in lines[-1]


def test_an_engine_keeping_fewer_picks_than_top_k_is_replayed_with_its_own():
    """The replay's isolated attention takes the engine's picks: a build whose indexer keeps 4
    where the golden keeps 8 is fed 4 and -1 (it crashed with 'expanded size (8) must match (4)')."""
    import numpy as np
    import torch

    from fidelity.llamacpp.selection import engine_picks as _engine_picks
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.2, 0.8, 0.7, 0.6, 0.4, float("-inf")]] * 2)
    picks = np.array([[2, 5, 6, 9], [0, 1, 2, 3]])             # row 0's entry 9 is not visible here
    got = _engine_picks(picks)(None, scores, 8)
    assert got.shape == (2, 8)
    assert got[0].tolist() == [-1, -1, -1, -1, -1, 2, 5, 6] and got[1].tolist() == [-1] * 4 + [0, 1, 2, 3]


def test_a_selection_beyond_the_scores_floor_leads_the_headline_though_every_block_matches():
    """The seeds' class: an index-key precision bug moves the picks while every block, fed the
    engine's own picks, matches its twin -- the selection is said first, with its rows."""
    worst = {"row": 7, "lost": 1, "entry": 30, "loss": 0.2, "floor": 1e-4, "x_floor": 2000.0}
    sel = [None, {"layer": 1, "rows": 209, "k": 8, "engine_k": 8, "differ": 11, "beyond": 11, "worst": worst}]
    ok = _iso({TWIN: [1e-6] * 2}, [1e-6] * 2).assign(selection=sel)
    table = pd.DataFrame({"layer": [0], "tensor": ["attn.q"], "engine_tensor": ["q-0"], "vs golden": [1e-7],
                          f"vs {TWIN}": [1e-7], "floor": [4e-5], "twin floor": [1e-7]})
    lines = R.headline(R.findings(table, {"attention": ok, "MoE": ok}, "prefill", "f16"))
    assert lines[0].startswith("llama.cpp's indexer selects other entries than its twin, fed the same inputs: "
                               "11 of 209 rows at layer 1 lose an entry beyond the scores' floor"), lines
    assert "2e+03x the floor" in lines[0]
    assert lines[1].startswith("Fed llama.cpp's own inputs, every block")


def test_the_isolated_moe_floor_holds_a_quantizer_a_rounding_apart():
    """An engine computing the experts' quantized activations one float32 ulp apart (x * 1/d
    for x / d) flips a Q8_0 step wherever a value sits on a boundary: fed such an input, the
    twin itself must stay within 10x of the isolated MoE's floor (a clean llama.cpp build once
    departed at one layer by 50x a floor of reduction order alone)."""
    import numpy as np
    import torch
    from fidelity.pipeline.model import arm_numerics
    from reference_model import random_weights, tiny
    from reference_model.model import moe_experts
    w = random_weights(tiny(), 0)
    cfg, rng, n = w.cfg, np.random.default_rng(0), 200
    arms = {R.TWIN_FLOOR: arm_numerics(TWIN, "reference", {"compute_dtype": torch.float64}, "v4"),
            TWIN: arm_numerics(TWIN, "reference", {}, "v4")}
    engine = {}
    for i in range(cfg.n_layers):
        x = rng.standard_normal((n, cfg.dim)).astype(np.float32)
        idx = np.stack([rng.choice(cfg.n_routed_experts, cfg.n_activated_experts, replace=False) for _ in range(n)])
        wt = rng.random(idx.shape).astype(np.float32)
        nx = arms[TWIN]
        other = moe_experts(nx, cfg, w.layer_weights(i), torch.tensor(I.nudged(x, 7)).to(nx.cd),
                            torch.tensor(idx).long(), torch.tensor(wt).to(nx.cd)).double().numpy()
        engine |= {f"ffn_norm-{i}": x, f"ffn_moe_topk-{i}": idx, f"ffn_moe_weights_scaled-{i}": wt,
                   f"ffn_out-{i}": other}
    moe = I.isolated_moe(engine, w, arms, TWIN)
    flips = moe[moe[f"vs {TWIN}"] > 1e-5]
    assert len(flips), "the nudge flips no quantizer step: the test shows nothing"
    assert R.block_unexplained(moe, "MoE") is None
    assert R.block_unexplained(moe.assign(floor=3e-7), "MoE") is not None   # reduction order alone: "departs"
    x = engine["ffn_norm-0"]
    d = np.abs(I.nudged(x).astype(np.float64) - x)
    assert (d > 0).all() and (d == np.abs(np.spacing(x))).mean() > 0.4    # one ulp, either way
