"""mlx-vlm's pieces that run without mlx-vlm: the harness's routes, which compressed entries
cross a call (hand-derived), the f32 copy against our own loader, the replay's reading of
departing entries. The engine itself: test_mlxvlm_engine.py (marked `mlx`)."""
import json

import numpy as np
import pytest
import torch

from fidelity.mlxvlm import convert, harness, replay as X


def test_routes_cover_the_prompt_in_the_calls_a_program_makes():
    assert harness.routes("prefill", 10) == [10]
    assert harness.routes("decode", 3) == [1, 1, 1]
    assert harness.routes("chunked:4", 10) == [4, 4, 2]
    assert harness.routes("nocache", 10) is None
    # mlx-vlm's generate: all but the last token in calls of 2048, then the last token alone
    assert harness.routes("generate", 5000) == [2048, 2048, 903, 1]
    assert harness.routes("generate", 2049) == [2048, 1]
    for bad in ("chunked:0", "chunked:x", "sideways"):
        with pytest.raises(SystemExit, match="unknown route"):
            harness.routes(bad, 10)


def test_top_k_is_every_id_when_k_exceeds_the_vocabulary():
    lp = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    ids, vals = harness.top(lp, 2)
    assert ids.tolist() == [[1, 2], [0, 2]] and np.allclose(np.exp(vals), [[0.6, 0.3], [0.5, 0.3]])
    assert harness.top(lp, 1 << 30)[0].shape == (2, 3)


def test_generation_samples_at_the_requested_temperature_with_its_seed():
    lp = np.log(np.array([0.7, 0.2, 0.1]))
    assert harness.sampler(0.0, 1.0, 0) is None                                   # greedy
    draws = [harness.sampler(1.0, 1.0, 7)(lp) for _ in range(3)]
    assert len(set(draws)) == 1                                                   # one seed, one first draw
    pick = harness.sampler(1.0, 1.0, 0)
    freq = np.bincount([pick(lp) for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(freq, [0.7, 0.2, 0.1], atol=0.03)                          # softmax(lp / 1)
    nucleus = harness.sampler(1.0, 0.75, 0)
    assert {nucleus(lp) for _ in range(300)} == {0, 1}                           # top_p 0.75: 0.7 + 0.2 kept
    cold = harness.sampler(0.25, 1.0, 0)
    assert np.mean([cold(lp) == 0 for _ in range(500)]) > 0.95                    # sharper at T 0.25


def test_entries_whose_preceding_window_crossed_a_call():
    # ratio 4, 6 entries: entry j is tokens 4j..4j+3, completed by the call holding token 4j+3
    assert X.crossing(4, 6, [1] * 24).tolist() == [False] + [True] * 5          # one token per call
    assert X.crossing(4, 6, [24]).tolist() == [False] * 6                        # one call
    # calls of 8: entries 0,1 in call 0; 2,3 in call 1; 4,5 in call 2
    assert X.crossing(4, 6, [8, 8, 8]).tolist() == [False, False, True, False, True, False]
    assert X.crossing(4, 6, None).tolist() == [False] * 6                        # no cache: one call


def _row(**kw):
    base = {"layer": 1, "tensor": "kv_comp", "what": "the attention's compressor", "entries": 60, "departing": 59,
            "crossing": 59, "departing_crossing": 59, "departing_within": 0, "error_min": 0.4, "error_max": 1.0,
            "x_floor": 1e6, "error_crossing": 1.0, "error_within": 3e-7}
    return {**base, **kw}


def test_a_departure_is_read_as_the_call_boundary_only_when_the_entries_say_so():
    assert X.across_calls(_row())
    assert "exactly the 59 whose preceding window was completed in an earlier call; the other 1 match" in X._entries(_row())
    # every entry departs, those across calls 300x more: still the call boundary, on top of a precision gap
    mixed = _row(departing=60, departing_within=1, error_within=0.0033)
    assert X.across_calls(mixed) and "by up to 1, the other 1 by up to 0.0033" in X._entries(mixed)
    # as much within a call as across: not the call boundary
    assert not X.across_calls(_row(departing=60, departing_within=1, error_within=0.5))
    assert not X.across_calls(_row(crossing=0, departing_crossing=0, departing=60, departing_within=60))
    both = X.compressor_words([_row(), _row(tensor="lid_comp", what="the indexer's compressor")])
    assert both.startswith("layer 1, the attention's compressor and the indexer's compressor alike: 59 of 60")


def test_f32_copy_holds_our_loaders_values_exactly_under_deepseeks_names(tmp_path, monkeypatch):
    from fidelity.weights.source import load_weights
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from fidelity.llamacpp.paths import REPO
    src = REPO / "models" / "tiny-needle-v2"
    out = convert.model_dir(src, "f32")
    assert out.parent == tmp_path / "dsv4-fidelity" / "mlx-vlm-models"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    from safetensors import safe_open
    shard = out / "model-00001-of-00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        keys = set(f.keys())
        assert not any(k.endswith(".scale") for k in keys)             # consumed by the dequantisation
        wq = f.get_tensor("layers.1.attn.wq_a.weight")
        w1 = f.get_tensor("layers.1.ffn.experts.3.w1.weight")
    assert wq.dtype == torch.float32 and w1.dtype == torch.float32
    dense, _ = load_weights(str(src), mode="dense")
    lw = dense.layer_weights(1)
    assert torch.equal(wq, lw["attn.wq_a.weight"].float())              # FP8 e4m3 x E8M0: exact in float32
    assert torch.equal(w1, lw["ffn.experts.3.w1.weight"].float())      # FP4 e2m1 x E8M0: exact too
    assert convert.model_dir(src, "f32") == out and (out / "SOURCE").is_file()    # cached, not rewritten
    assert convert.model_dir(src, "native") == src.resolve()
    with pytest.raises(ValueError, match="weights must be one of native, f32"):
        convert.model_dir(src, "q4")

