"""`fidelity kld` against a real `fidelity serve` process serving three arms (golden,
engine, engine + routed_scaling_double): for both dialects, the KL lower bound from top-k
never exceeds the in-process KL of the same arms and prompts, and exact mode equals it to
1e-6; the verdict names the planted bug; bad input is named."""
import json

import pandas as pd
import pytest

from fidelity.design.arms import parse_arm
from fidelity.cli import main
from fidelity.ab.metrics import kld_per_position
from fidelity.design.prompts import grid_prompts
from fidelity.weights.target import load_target
from reference_model import Model

from needle_util import served

T = load_target(None)
GRID = ["--lengths", "250,511", "--depths", "50", "--decode-steps", "4", "--n-boot", "200"]


@pytest.fixture(scope="module")
def url():
    with served("golden", extra=("--arm", "golden=golden", "--arm", "engine=engine", "--arm",
                                 "bug=engine,routed_scaling_double", "--max-logprobs", "-1")) as (u,):
        yield u


@pytest.fixture(scope="module")
def exact_kl():
    """In-process KL(golden ‖ engine) per prompt position, fp64 (fidelity ab's metric)."""
    prompts = grid_prompts(T.tokenizer, [250, 511], [50.0], 1, 0)
    g = Model(T.weights, parse_arm("golden").numerics())
    e = Model(T.weights, parse_arm("engine").numerics())
    return {p.id: kld_per_position(g.prefill_logits(p.tokens), e.prefill_logits(p.tokens)).numpy()
            for p in prompts}


def _run(tmp_path, url, *extra):
    out = tmp_path / "out"
    rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"engine={url}", *GRID,
               "--no-floors", "--out", str(out), "--run-id", "r", "--quiet", *extra])
    assert rc == 0
    return pd.read_csv(out / "kld" / "r" / "positions.csv.gz")


# the default run keeps the OpenAI dialect; SGLang's and vLLM's (~60-150 s each) run with -m slow
@pytest.mark.parametrize("dialect", [pytest.param("sglang", marks=pytest.mark.slow),
                                     pytest.param("vllm", marks=pytest.mark.slow), "openai"])
def test_http_kl_bounded_by_and_exactly_equal_to_in_process(tmp_path, url, exact_kl, dialect):
    pos = _run(tmp_path / "topk", url, "--dialect", f"engine={dialect}")
    pre = pos[(pos.arm == "engine") & (pos.phase == "prefill")]
    n_checked = 0
    for pid, kl in exact_kl.items():
        lb = pre[pre.prompt == pid].sort_values("position").kl_lb.to_numpy()
        assert len(lb) == len(kl)
        assert (lb <= kl + 1e-9).all()                     # a lower bound, everywhere
        covered = pre[pre.prompt == pid].sort_values("position").uncovered_p.to_numpy() < 1e-4
        assert (kl[covered] - lb[covered] < 1e-3).all()    # and close where little mass is missing
        n_checked += len(lb)
    assert n_checked == 761
    if dialect == "openai":                                # no way to ask for more ids
        return
    pos = _run(tmp_path / "exact", url, "--dialect", f"engine={dialect}", "--exact", "--exact-k", "512")
    pre = pos[(pos.arm == "engine") & (pos.phase == "prefill")]
    for pid, kl in exact_kl.items():
        lb = pre[pre.prompt == pid].sort_values("position").kl_lb.to_numpy()
        assert abs(lb - kl).max() < 1e-6


@pytest.mark.slow          # ~150 s; tests/test_kld_twin.py names an in-process bug in the default run
def test_verdict_names_the_planted_bug_and_report_is_complete(tmp_path, url):
    out = tmp_path / "out"
    rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"engine={url}",
               "--endpoint", f"bug={url}", *GRID, "--out", str(out), "--run-id", "r", "--quiet"])
    assert rc == 0
    m = json.loads((out / "kld" / "r" / "manifest.json").read_text())
    assert m["verdict"]["culprit"] == "bug"
    named = {n["toggle"]: n for n in m["verdict"]["named"]}
    assert named["bug"]["lo"] > named["bug"]["floor_hi"]
    assert [a["name"] for a in m["manifest"]["arms"]][:3] == ["golden", "engine", "bug"]
    assert "routed_scaling_double" in m["manifest"]["servers"]["bug"]["server_info"]["arms"]["bug"]["toggles"]
    rep = out / "kld" / "r"
    for f in ("kld_by_position.csv", "ladder_summary.csv", "captures.csv", "signals.png",
              "kld_vs_position.png", "decode_ladder.png", "index.html", "summary.md"):
        assert (rep / f).stat().st_size > 0
    kt = pd.read_csv(rep / "kld_by_position.csv")
    row = kt[(kt.arm == "bug") & (kt.bucket == "all")].iloc[0]
    assert row.kld_lo <= row.kld_mean <= row.kld_hi and row.same_top1 < 1
    # rerun: everything is reused (no request is sent again), same numbers
    rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"engine={url}",
               "--endpoint", f"bug={url}", *GRID, "--out", str(out), "--run-id", "r2", "--quiet"])
    assert rc == 0
    a = pd.read_csv(rep / "positions.csv.gz")
    b = pd.read_csv(out / "kld" / "r2" / "positions.csv.gz")
    pd.testing.assert_frame_equal(a, b)


def test_bad_inputs_are_named(tmp_path, url, capsys):
    def err(*args):
        rc = main(["kld", *args, *GRID, "--out", str(tmp_path), "--quiet", "--retries", "0"])
        assert rc == 2
        return capsys.readouterr().err
    assert "connection" in err("--arm", "golden=golden", "--endpoint", "x=http://127.0.0.1:9")
    assert "not served" in err("--arm", "golden=golden", "--endpoint", f"x={url}", "--model", "nope")
    assert "at least one arm" in err("--arm", "golden=golden")
    assert "unknown dialect" in err("--arm", "golden=golden", "--endpoint", f"e={url}",
                                    "--dialect", "e=tgi")
    assert "--max-logprobs" in err("--arm", "golden=golden", "--endpoint", f"engine={url}",
                                   "--dialect", "engine=vllm", "--top-k", "600")


def test_sglang_exact_ids_are_chunked_and_merged(url):
    """token_ids_logprob is scored at every position: a large id set goes in several
    requests whose per-position results are merged; same numbers as one request."""
    import numpy as np
    from fidelity.scores.dialects import Request
    from fidelity.kld.endpoint import Endpoint
    ids = T.tokenizer.encode("Rain falls on the old stone bridge at night, and the river keeps talking.")
    req = Request(k=5, steps=3, score_ids=tuple(range(T.cfg.vocab_size)), captures=True)
    one = Endpoint("engine", url, "sglang").connect()
    one.ids_per_request = 10_000
    many = Endpoint("engine", url, "sglang").connect()
    many.ids_per_request = 100                                # 6 requests
    a, b = one.score(ids, req), many.score(ids, req)
    assert a.ladder_tokens == b.ladder_tokens and np.array_equal(a.indexer, b.indexer)
    for x, y in zip(a.known + a.ladder, b.known + b.ladder):
        ox, oy = np.argsort(x.ids), np.argsort(y.ids)
        assert len(x.ids) == T.cfg.vocab_size and np.array_equal(x.ids[ox], y.ids[oy])
        assert np.array_equal(x.logp[ox], y.logp[oy])
