"""`fidelity kld` against a real `fidelity serve` process behind a proxy that spoils some
answers: a /get_model_info 200 of the wrong shape no longer turns captures off; captures
missing from /generate answers are retried, then reported per arm and signal (summary.md,
manifest, console) and filled on resume; a /tokenize or /generate 200 without what it
needs is retried as malformed, and when it stays malformed the error names endpoint,
route and what was missing (exit 2, no traceback); retries are counted per arm and route
in the manifest and on the console; kld's options show their defaults."""
import json

import pandas as pd
import pytest

from fidelity.cli import build_parser, main

from fault_proxy import FaultProxy
from needle_util import kld_exit, served

GRID = ["--lengths", "250,300", "--depths", "50,90", "--decode-steps", "2", "--n-boot", "100",
        "--no-floors", "--retries", "2", "--no-twin"]           # the twin is not what these tests are about
N = 4                                           # prompts


@pytest.fixture(scope="module")
def url():
    with served("golden", extra=("--arm", "golden=golden", "--arm", "engine=engine")) as (u,):
        yield u


def _kld(out, engine_url, *extra, quiet=True):
    return main(["kld", "--arm", "golden=golden", "--endpoint", f"engine={engine_url}", *GRID,
                 "--out", str(out), "--run-id", "r", *(["--quiet"] if quiet else []), *extra])


def _read(out):
    rep = out / "kld" / "r"
    return (json.loads((rep / "manifest.json").read_text()), pd.read_csv(rep / "captures.csv"),
            pd.read_csv(rep / "positions.csv.gz"), (rep / "summary.md").read_text())


@pytest.fixture(scope="module")
def clean(url, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    assert _kld(out, url) == kld_exit(out / "kld" / "r")
    return _read(out)


def _strip(d):
    """A /generate answer that lost its captures."""
    return {**d, "meta_info": {k: v for k, v in d["meta_info"].items()
                               if k not in ("indexer_topk", "routed_experts")}}


def _cov(m, arm="engine"):
    return {r["captures"]: (r["prompts"], r["of"]) for r in m["manifest"]["capture_coverage"]
            if r["arm"] == arm}


def test_capture_faults_are_retried_reported_and_filled_on_resume(url, clean, tmp_path, capsys):
    out = tmp_path / "o"
    faults = {"/get_model_info": [lambda d: {"model_path": "x"}],       # start-up: wrong shape
              "/generate": ["ok", "ok", _strip, _strip, _strip]}        # the identity probe, prompt 1, prompt 2: 1 + 2 retries
    px = FaultProxy(url, faults).__enter__()                 # one proxy: arms keep their URL
    try:
        assert _kld(out, px.url, quiet=False) == kld_exit(out / "kld" / "r")
        assert px.count("/get_model_info", "GET") == 2       # asked again once captures came
        cap = capsys.readouterr()
        m, caps, pos, md = _read(out)
        assert _cov(m) == {"indexer": (N - 1, N), "experts": (N - 1, N)}
        assert _cov(m, "golden") == {"indexer": (N, N), "experts": (N, N)}
        assert m["manifest"]["retries"] == {"engine": {"total": 2, "routes": {"POST /generate (captures)": 2}}}
        assert "**Incomplete:** `engine` indexer (topk_loss, needle_lost) on 3 of 4 prompts: captures " \
               "requested but absent from the answer" in md
        assert "- `engine`: 2 (POST /generate (captures) 2)" in md
        assert "retries: engine 2 (POST /generate (captures) 2)" in cap.out
        assert "warning: engine: indexer captures (topk_loss, needle_lost) on 3 of 4 prompts" in cap.err
        assert cap.err.count("retry 1/2") == 1 and cap.err.count("retry 2/2") == 1
        assert caps.prompt.nunique() == N - 1 < clean[1].prompt.nunique()
        pd.testing.assert_frame_equal(pos, clean[2])                   # KL itself unaffected
        # resume (the faults are used up): the identity probe, then only the prompt without
        # captures is asked again
        n = px.count("/generate")
        assert _kld(out, px.url) == kld_exit(out / "kld" / "r")
        assert px.count("/generate") - n == 2
    finally:
        px.__exit__()
    m, caps, pos, md = _read(out)
    assert _cov(m) == {"indexer": (N, N), "experts": (N, N)} and "Incomplete" not in md
    pd.testing.assert_frame_equal(caps, clean[1])
    pd.testing.assert_frame_equal(pos, clean[2])


def test_tokenize_without_tokens_is_retried_then_named(url, tmp_path, capsys):
    with FaultProxy(url, {"/tokenize": [lambda d: {"count": d["count"]}]}) as px:
        assert _kld(tmp_path / "a", px.url) == kld_exit(tmp_path / "a" / "kld" / "r")
        assert px.count("/tokenize") == 2
    m = _read(tmp_path / "a")[0]
    assert m["manifest"]["retries"]["engine"]["routes"] == {"POST /tokenize": 1}
    capsys.readouterr()
    with FaultProxy(url, {"/tokenize": [lambda d: {"count": d["count"]}] * 3}) as px:
        assert _kld(tmp_path / "b", px.url) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyError" not in err
    assert (f"error: engine: POST {px.url}/tokenize failed after 3 attempts: HTTP 200 with a "
            "malformed answer: no `tokens` list in the answer") in err


def test_malformed_generate_is_retried_then_named_without_dialect_hint(url, clean, tmp_path, capsys):
    bad = lambda d: {"meta_info": {"id": "x"}}                           # noqa: E731
    with FaultProxy(url, {"/generate": ["ok", "ok", bad]}) as px:       # the identity probe's request first
        assert _kld(tmp_path / "a", px.url) == kld_exit(tmp_path / "a" / "kld" / "r")
        assert px.count("/generate") == N + 2
    m, caps, pos, _ = _read(tmp_path / "a")
    assert m["manifest"]["retries"]["engine"]["routes"] == {"POST /generate": 1}
    pd.testing.assert_frame_equal(pos, clean[2])
    pd.testing.assert_frame_equal(caps, clean[1])
    capsys.readouterr()
    with FaultProxy(url, {"/generate": ["ok", "ok"] + [bad] * 3}) as px:
        assert _kld(tmp_path / "b", px.url) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--dialect" not in err
    assert (f"error: engine: POST {px.url}/generate failed after 3 attempts: HTTP 200 with a "
            "malformed answer: the /generate response has no meta_info input/output logprobs") in err


def test_kld_options_show_their_defaults():
    sub = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "kld")[1]
    helps = {a.dest: a.help or "" for a in sub._actions}
    for dest, default in [("lengths", "250,511,1023"), ("depths", "10,50,90"), ("reps", "1"),
                          ("seed", "0"), ("exact_k", "64"), ("n_boot", "1000"), ("retries", "4"),
                          ("timeout", "600.0")]:
        assert "%(default)s" in helps[dest] and str(sub.get_default(dest)) == default
    assert helps["no_captures"] and "kld-<timestamp>" in helps["run_id"]
