"""The twin search (fidelity.llamacpp.twin_search) on a stand-in engine, no llama.cpp needed:
an "engine" whose tensors are an in-process arm's with one more toggle is reproduced by the
search adding exactly that toggle to the twin; an engine equal to the twin needs no search;
an engine no toggle reproduces is said to be so."""
import numpy as np
import torch

from fidelity.llamacpp import replay as R
from fidelity.llamacpp import twin_search as S
from fidelity.pipeline.model import arm_numerics
from reference_model import random_weights, tiny

TWIN = R.twin_of("f16")
IDS = list(range(3, 67))


def _setup(engine_arm: str | None, noise: float = 0.0):
    w = random_weights(tiny(), 0)
    arms = {R.GOLDEN: arm_numerics("golden", "reference", {}, "v4"), R.FLOOR: arm_numerics("golden", "reference",
                                                                                          {"compute_dtype": torch.float32}, "v4"),
            R.TWIN_FLOOR: arm_numerics(TWIN, "reference", {"compute_dtype": torch.float64}, "v4"),
            TWIN: arm_numerics(TWIN, "reference", {}, "v4")}
    taps = {n: R.taps_of(w, nx, IDS, "prefill") for n, nx in arms.items()}
    src = taps[TWIN] if engine_arm is None else R.taps_of(w, arm_numerics(engine_arm, "reference", {}, "v4"),
                                                           IDS, "prefill")
    g = torch.Generator().manual_seed(0)
    engine = {}
    for i in range(w.cfg.n_layers):
        for gname, lname in R.PAIRS:
            t = src[f"layers.{i}.{gname}"].double()
            engine[f"{lname}-{i}"] = (t * (1 + noise * torch.randn(t.shape, generator=g, dtype=t.dtype))).numpy()
    return w, engine, taps, R.compare(engine, taps, w.cfg.n_layers, TWIN)


def test_candidates_are_forward_toggles_outside_the_twins_groups():
    c = S.candidates(TWIN)
    assert "yarn_on_swa_layers" in c and "mhc_bf16" in c
    assert not {"kv_bf16", "kv_cache_ggml", "moe_weight_after_w2", "expert_act_q8_0"} & set(c)   # groups held
    assert not {"restore_window_one_off", "verify_ignores_temperature", "v4_dsml_parser"} & set(c)
    assert not any(n.startswith("v41_") for n in c)                                           # V4.1 only


def test_the_search_names_the_toggle_the_engine_computes():
    w, engine, taps, table = _setup(f"{TWIN},yarn_on_swa_layers")
    assert R.first_unexplained(table, TWIN) is not None
    s = S.search(engine, w, IDS, "prefill", table, taps[R.GOLDEN], TWIN, steps=2)
    assert s["added"] == ["yarn_on_swa_layers"] and s["to"] is None
    assert s["from"]["tensor"] == "attn.q"                   # the RoPE'd query departs first
    assert "adding yarn_on_swa_layers to the twin reproduces llama.cpp at every tensor" in S.sentence(s)


def test_no_search_for_the_twin_and_words_for_what_no_toggle_explains():
    w, engine, taps, table = _setup(None)
    s = S.search(engine, w, IDS, "prefill", table, taps[R.GOLDEN], TWIN)
    assert s["from"] is None and not s["tried"] and "not needed" in S.sentence(s)
    w, engine, taps, table = _setup(None, noise=0.05)        # 5% noise on every tensor: no toggle's kind
    s = S.search(engine, w, IDS, "prefill", table, taps[R.GOLDEN], TWIN, steps=1)
    assert s["added"] == [] and s["from"]["layer"] == 0 and len(s["tried"]) == len(S.candidates(TWIN))
    assert np.isfinite([r["error_there"] for r in s["tried"]]).all()
    assert "arithmetic no toggle models" in S.sentence(s)
