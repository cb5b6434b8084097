"""The per-prompt tools on a DeepSeek-V4.1 model in one process (issue 25): the serving
prefix cache restores V4.1's whole sequence state (Engram history, last index-key writer)
so a hit gives the cold logits bit for bit; needle's mechanism rows are V4.1's index
sources at their own ratios (disjoint entries), batched layer-major = one at a time; kld's
captures are read on the index sources; `engine` arms are V4.1's in kld and serve."""
import json

import httpx
import pandas as pd
import pytest
import torch

from fidelity.design.arms import parse_arm
from fidelity.cli import main
from fidelity.scores.inprocess import capture_shape
from fidelity.needle_run.runner import InProcessOptions, InProcessRunner
from fidelity.serve.prefix_cache import PrefixCache, page_keys, paged_prefill, restore
from fidelity.weights.target import load_target
from kernel_toggles import ToggleSet
from needle.sweep import SweepConfig, run_sweep
from reference_model import build_model
from reference_model.v41.checkpoint_write import save_checkpoint
from reference_model.v41.config import tiny_v41
from reference_model.v41.weights import random_weights

from needle_util import kld_exit, ok, served

CFG = tiny_v41()
PAGE = 16


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, 0)


@pytest.fixture(scope="module")
def model(weights):
    return build_model(weights)


@pytest.fixture(scope="module")
def checkpoint(weights, tmp_path_factory):
    return save_checkpoint(weights, tmp_path_factory.mktemp("ckpt") / "tiny_v41")


def _ids(n, seed):
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefix_cache_hit_equals_cold_on_v41(model):
    a = _ids(70, 1)
    b = torch.cat([a[:50], _ids(20, 2)])                 # shares 50 tokens: 48 page-aligned
    cache = PrefixCache(PAGE)
    paged_prefill(model, a, model.new_state(), cache, page_keys("g", a.tolist(), PAGE), False)
    keys = page_keys("g", b.tolist(), PAGE)
    n, stored = cache.lookup(keys, len(b), len(b))
    assert n == 48
    hit, _ = paged_prefill(model, b, restore(model, stored), cache, keys, True)
    cold, _ = paged_prefill(model, b, model.new_state(), None, keys, True)
    assert torch.equal(hit, cold[n:])
    again, _ = paged_prefill(model, b, restore(model, stored), None, keys, False)
    assert torch.equal(again, cold[-1:])                 # the stored snapshot was not touched


def test_needle_mechanism_rows_are_v41_index_sources(checkpoint, tmp_path):
    target = load_target(checkpoint)
    cfg = SweepConfig(lengths=[200], depths=[0, 50])
    one = run_sweep(cfg, [InProcessRunner("golden", target, parse_arm("golden"), options=InProcessOptions(batch=1))],
                    tmp_path / "one.jsonl", quiet=True)
    batched = run_sweep(cfg, [InProcessRunner("golden", target, parse_arm("golden"))],
                        tmp_path / "batched.jsonl", quiet=True)
    for a, b in zip(one, batched):
        assert a["error"] is None and a["mechanism"] == b["mechanism"] and a["response"] == b["response"]
    row = one[-1]
    layers = [m["layer"] for m in row["mechanism"]]
    assert layers == CFG.indexer_layers() and {CFG.compress_ratios[i] for i in layers} == {1, 2}
    pos = row["n_tokens"] - 1
    for m in row["mechanism"]:
        r = CFG.compress_ratios[m["layer"]]
        assert m["n_visible"] == (pos + 1) // r
        assert m["entries"] == sorted({t // r for t in row["value_token_positions"]})
        assert (m["best_rank"] <= m["topk"]) == m["in_topk"] or CFG.uses_candidates(m["layer"])


@pytest.fixture(scope="module")
def kld_run(checkpoint, tmp_path_factory):
    """One small in-process kld on the tiny V4.1 checkpoint, with captures."""
    out = tmp_path_factory.mktemp("kld")
    rc = main(["kld", "--threads", "1", "--checkpoint", str(checkpoint), "--arm", "golden=golden",
               "--arm", "eng=engine", "--no-floors", "--lengths", "200", "--depths", "50",
               "--reps", "1", "--n-boot", "20", "--out", str(out), "--run-id", "x"])
    assert rc == kld_exit(next(out.rglob("x")))
    return next(out.rglob("x"))


def test_kld_captures_on_v41_index_sources(kld_run):
    caps = pd.read_csv(kld_run / "captures.csv")
    assert sorted(caps[caps.signal == "topk_loss"].layer.unique()) == CFG.indexer_layers()
    assert capture_shape(CFG)["indexer_layers"] == CFG.indexer_layers() == [2, 4, 6, 8]


def test_kld_engine_arm_is_v41s(kld_run):
    arms = {a["name"]: a["arm"] for a in json.loads((kld_run / "manifest.json").read_text())["manifest"]["arms"]}
    assert arms["eng"] == str(ToggleSet.parse("engine", "v41")) != str(ToggleSet.parse("engine"))


def test_serve_v41_engine_arm_indexer_layers_and_prefix_hit(checkpoint):
    """One server on the tiny V4.1 checkpoint: `engine` is V4.1's, /get_model_info names the
    index sources, and a prefix-cache hit answers as the cold request."""
    ids = _ids(60, 3).tolist()
    with served("golden", extra=("--checkpoint", str(checkpoint), "--arm", "golden=golden",
                                 "--arm", "eng=engine", "--page-size", str(PAGE))) as (url,):
        info = ok(httpx.get(url + "/get_server_info", timeout=30))
        assert info["arms"]["eng"]["toggles"] == [str(t) for t in ToggleSet.parse("engine", "v41")]
        assert ok(httpx.get(url + "/get_model_info", timeout=30))["indexer_layers"] == CFG.indexer_layers()
        runs = []
        for prompt in (ids, ids[:50] + ids[:10], None, ids[:50] + ids[:10]):
            if prompt is None:
                assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
                continue
            r = ok(httpx.post(url + "/v1/completions", json={
                "model": "golden", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                "ignore_eos": True}, timeout=300))
            runs.append((r["choices"][0]["logprobs"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert runs[1][1] == 48 and runs[2][1] == 0 and runs[1][0] == runs[2][0]
